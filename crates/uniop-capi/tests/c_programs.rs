//! The C ABI as C and C++ callers see it: `examples/c/` compiled with gcc/g++ against the header
//! and the library this test run built, run (their own checks compare with double-precision
//! references and try every bad input), and the C programs again under valgrind's memcheck (no
//! invalid accesses, no definite leaks). The header must match what the generator writes.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

/// The directory holding `libuniop_capi.so` and the example plugin for this test's profile
/// (the test binary lives in `deps/` below it). `cargo test` does not build `cdylib`s, so the
/// first caller builds both with the same profile.
fn lib_dir() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let exe = std::env::current_exe().unwrap();
            let dir = exe.parent().and_then(Path::parent).unwrap().to_path_buf();
            let mut cargo = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
            cargo.current_dir(repo()).args(["build", "-q", "-p", "uniop-capi", "-p", "uniop-plugin-example"]);
            if dir.ends_with("release") {
                cargo.arg("--release");
            }
            assert!(cargo.status().unwrap().success(), "building the C API and the example plugin");
            assert!(dir.join("libuniop_capi.so").exists(), "libuniop_capi.so not built in {}", dir.display());
            dir
        })
        .clone()
}

fn build(compiler: &str, std: &str, source: &str) -> PathBuf {
    compile(compiler, &[std, "-Wall", "-Wextra", "-Werror", "-O1", "-g"], source, "")
}

fn compile(compiler: &str, flags: &[&str], source: &str, suffix: &str) -> PathBuf {
    let stem = Path::new(source).file_stem().unwrap().to_string_lossy();
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{stem}{suffix}"));
    let lib = lib_dir();
    let status = Command::new(compiler)
        .args(flags)
        .arg("-I")
        .arg(repo().join("include"))
        .arg(repo().join(source))
        .arg("-o")
        .arg(&out)
        .arg(format!("-L{}", lib.display()))
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .args(["-luniop_capi", "-lm"])
        .status()
        .unwrap_or_else(|e| panic!("running {compiler}: {e}"));
    assert!(status.success(), "{compiler} failed on {source}");
    out
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    println!("{text}");
    assert!(out.status.success(), "{cmd:?} failed:\n{text}");
    text
}

/// valgrind's memcheck, failing on any invalid access and on definite leaks.
fn memcheck() -> Command {
    let mut cmd = Command::new("valgrind");
    cmd.args([
        "--error-exitcode=99",
        "--leak-check=full",
        "--errors-for-leak-kinds=definite",
        "--show-leak-kinds=definite",
    ]);
    cmd
}

#[test]
fn c_program_passes_its_checks_and_memcheck() {
    let exe = build("gcc", "-std=c11", "examples/c/two_phase.c");
    let text = run(&mut Command::new(&exe));
    assert!(text.contains("0 failed checks") && !text.contains("FAIL"), "{text}");
    let text = run(memcheck().arg(&exe).arg("--no-fork"));
    assert!(text.contains("ERROR SUMMARY: 0 errors"), "{text}");
}

#[test]
fn c_program_loads_a_plugin_and_rejects_bad_ones() {
    let plugin = lib_dir().join("libuniop_plugin_example.so");
    let wrong_abi = compile("gcc", &["-shared", "-fPIC"], "examples/c/wrong_abi_plugin.c", ".so");
    let exe = build("gcc", "-std=c11", "examples/c/plugin.c");
    let text = run(Command::new(&exe).arg(&plugin).arg(&wrong_abi));
    assert!(text.contains("0 failed checks") && !text.contains("FAIL"), "{text}");
    let text = run(memcheck().arg(&exe).arg(&plugin).arg(&wrong_abi));
    assert!(text.contains("ERROR SUMMARY: 0 errors"), "{text}");
}

#[test]
fn cpp_program_passes() {
    let exe = build("g++", "-std=c++17", "examples/c/rms_norm.cpp");
    assert!(run(&mut Command::new(&exe)).contains("PASS"));
}
