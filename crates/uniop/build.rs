// Records the compiler version: Rust op plugins must be built by the same compiler as the
// library that loads them (Rust has no stable ABI), and `plugin::load` checks it.
use std::process::Command;

fn main() {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let version = Command::new(rustc)
        .arg("-V")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .unwrap_or_else(|| "unknown rustc".into());
    println!("cargo:rustc-env=UNIOP_RUSTC_VERSION={}", version.trim());
    println!("cargo:rerun-if-env-changed=RUSTC");
}
