//! Build script of the `kiln` package: records the Rust target triple the
//! binaries are built for, which `kiln inspect` reports.

fn main() {
    let target = std::env::var("TARGET").expect("cargo sets TARGET");
    println!("cargo::rustc-env=KILN_TARGET={target}");
}
