//! Generates the C header from src/ffi with cbindgen into OUT_DIR/tinyloop.h. The checked-in
//! include/tinyloop.h must equal it: tests/header.rs compares the two (the path of the generated
//! header reaches the test through the TINYLOOP_GENERATED_HEADER compile-time variable).
//! On Linux it also gives libtinyloop.so its soname.

fn main() {
    println!("cargo:rerun-if-changed=src/ffi");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    println!("cargo:rerun-if-changed=build.rs");
    let crate_dir = std::env::var("CARGO_MANIFEST_DIR").expect("set by cargo");
    let out_dir = std::env::var("OUT_DIR").expect("set by cargo");
    let config = cbindgen::Config::from_file(format!("{crate_dir}/cbindgen.toml"))
        .expect("cbindgen.toml is readable");
    let header = format!("{out_dir}/tinyloop.h");
    // Parse only the FFI module (and its submodules), so that public constants elsewhere in the
    // crate never leak into the C header.
    cbindgen::Builder::new()
        .with_src(format!("{crate_dir}/src/ffi/mod.rs"))
        .with_config(config)
        .generate()
        .expect("cbindgen can parse src/ffi")
        .write_to_file(&header);
    println!("cargo:rustc-env=TINYLOOP_GENERATED_HEADER={header}");
    // Programs linked against the library by path (CMake's imported targets do that) then record
    // `libtinyloop.so`, found through their run path, instead of the path at link time.
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libtinyloop.so");
    }
}
