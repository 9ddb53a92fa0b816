// Command generate prints text generated from a byte-level model by the Go binding of TinyLoop.
//
//	generate MODEL.tinyloop [PROMPT]
//
// It exits 1 on any failure or when nothing was generated.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"

	tinyloop "github.com/tinyloop/tinyloop/bindings/go"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: generate MODEL.tinyloop [PROMPT]")
		os.Exit(2)
	}
	text := "ROMEO:"
	if len(os.Args) > 2 {
		text = os.Args[2]
	}
	if err := generate(os.Args[1], text); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

func generate(path, text string) error {
	model, err := tinyloop.Open(path, nil)
	if err != nil {
		return err
	}
	defer model.Close()
	prompt := make([]int32, len(text))
	for i := 0; i < len(text); i++ {
		prompt[i] = int32(text[i])
	}
	opts := tinyloop.DefaultGenerateOptions()
	opts.MaxTokens = 64
	out, err := model.Generate(context.Background(), prompt, &opts)
	if err != nil {
		return err
	}
	generated := make([]byte, len(out))
	for i, token := range out {
		generated[i] = '?'
		if token < 256 {
			generated[i] = byte(token)
		}
	}
	fmt.Printf("%s%s\n", text, generated)
	if len(out) == 0 {
		return errors.New("no tokens generated")
	}
	return nil
}
