//! Generates `include/uniop.h` from the C API crate with cbindgen, so the header always says what
//! the library exports. `--check` compares instead of writing and fails when the committed header
//! is stale (run by the test suite).

use std::path::Path;
use std::process::ExitCode;

fn generate() -> Result<String, cbindgen::Error> {
    let crate_dir = env!("CARGO_MANIFEST_DIR");
    let config = cbindgen::Config {
        language: cbindgen::Language::C,
        header: Some(
            "/* uniop C API. Generated from crates/uniop-capi by `cargo run -p uniop-capi --features header \
             --bin uniop-header`; do not edit. */"
                .into(),
        ),
        include_guard: Some("UNIOP_H".into()),
        cpp_compat: true,
        usize_is_size_t: true,
        documentation: true,
        documentation_style: cbindgen::DocumentationStyle::C99,
        style: cbindgen::Style::Type,
        sys_includes: vec!["stdbool.h".into(), "stddef.h".into(), "stdint.h".into()],
        no_includes: true,
        ..Default::default()
    };
    let mut out = Vec::new();
    cbindgen::Builder::new().with_crate(crate_dir).with_config(config).generate()?.write(&mut out);
    Ok(String::from_utf8(out).expect("cbindgen writes UTF-8"))
}

fn main() -> ExitCode {
    let header = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../include/uniop.h");
    let text = match generate() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("uniop-header: {e}");
            return ExitCode::FAILURE;
        }
    };
    if std::env::args().any(|a| a == "--check") {
        let committed = std::fs::read_to_string(&header).unwrap_or_default();
        if committed != text {
            eprintln!(
                "uniop-header: include/uniop.h is stale; regenerate it with \
                 `cargo run -p uniop-capi --features header --bin uniop-header`"
            );
            return ExitCode::FAILURE;
        }
        println!("include/uniop.h is up to date");
        return ExitCode::SUCCESS;
    }
    if let Err(e) = std::fs::write(&header, text) {
        eprintln!("uniop-header: writing {}: {e}", header.display());
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
