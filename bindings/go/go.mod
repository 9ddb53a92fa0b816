module github.com/tinyloop/tinyloop/bindings/go

go 1.19
