//! Writes the C API's generated files, so they always say what the library exports:
//! - `crates/uniop-capi/src/ops.rs`: a typed two-phase pair per registered op, generated from its
//!   schema (`uniopRmsNormGetWorkspaceSize(x, weight, eps, y, rstd, &wsSize, &executor)` +
//!   `uniopRmsNorm(ws, wsSize, executor, stream)`), each a thin call into the generic plan;
//! - `include/uniop.h`: cbindgen's header for the whole crate, generated functions included.
//!
//! `--check` compares instead of writing and fails when either committed file is stale (the test
//! suite runs it).

use std::fmt::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use uniop::schema::{Arg, BaseType, OpSchema};
use uniop::Registry;

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `rms_norm` → `RmsNorm`.
fn camel(name: &str) -> String {
    name.split('_').filter(|p| !p.is_empty()).map(|p| p[..1].to_uppercase() + &p[1..]).collect()
}

/// The C parameters of one schema argument, as Rust FFI types.
fn params(arg: &Arg) -> Result<Vec<String>, String> {
    let n = &arg.name;
    let ty = arg.ty;
    Ok(match (ty.base, ty.optional) {
        (BaseType::Tensor, _) if ty.mutated.is_some() => vec![format!("{n}: *mut uniopTensor")],
        (BaseType::Tensor, _) => vec![format!("{n}: *const uniopTensor")],
        (BaseType::TensorList, false) => vec![format!("{n}: *const uniopTensorList")],
        (BaseType::Int, false) => vec![format!("{n}: i64")],
        (BaseType::Int, true) => vec![format!("{n}: *const i64")],
        (BaseType::Float, false) => vec![format!("{n}: f64")],
        (BaseType::Float, true) => vec![format!("{n}: *const f64")],
        (BaseType::Bool, false) => vec![format!("{n}: bool")],
        (BaseType::Bool, true) => vec![format!("{n}: *const bool")],
        (BaseType::Str, false) => vec![format!("{n}: *const c_char")],
        (BaseType::ScalarType, false) => vec![format!("{n}: uniopDataType")],
        // Handles: NULL is None for an optional argument, an error otherwise.
        (BaseType::Scalar, _) => vec![format!("{n}: *const uniopScalar")],
        (BaseType::IntList, _) => vec![format!("{n}: *const uniopIntArray")],
        (BaseType::ScalarType, true) => vec![format!("{n}: *const uniopDataType")],
        // No built-in op takes these yet; map them when one does (the by-name call serves them today).
        (base, optional) => {
            return Err(format!("argument '{n}': {base:?}{} has no C mapping yet", if optional { "?" } else { "" }))
        }
    })
}

/// The expression turning a C attribute argument into an `AttrValue` (may use `?`).
fn attr_value(arg: &Arg) -> String {
    let n = &arg.name;
    // The conversion of one C value `v`, and whether it can fail (returns a `Result`).
    let convert = |v: &str| match arg.ty.base {
        BaseType::Int => (format!("AttrValue::Int({v})"), false),
        BaseType::Float => (format!("AttrValue::Float({v})"), false),
        BaseType::Bool => (format!("AttrValue::Bool({v})"), false),
        BaseType::ScalarType => (format!("typed::dtype(F, \"{n}\", {v})"), true),
        BaseType::Str => (format!("typed::string(F, \"{n}\", {v})"), true),
        _ => unreachable!("rejected by params()"),
    };
    let handle = match arg.ty.base {
        BaseType::Scalar => Some("scalar_value"),
        BaseType::IntList => Some("int_array_value"),
        _ => None,
    };
    if let Some(read) = handle {
        return match arg.ty.optional {
            true => format!("if {n}.is_null() {{ AttrValue::None }} else {{ {read}(F, \"{n}\", {n})? }}"),
            false => format!("{read}(F, \"{n}\", {n})?"),
        };
    }
    match (arg.ty.optional, convert(if arg.ty.optional { "v" } else { n })) {
        (true, (expr, true)) => format!("typed::optional({n}, |v| {expr})?"),
        (true, (expr, false)) => format!("typed::optional({n}, |v| Ok({expr}))?"),
        (false, (expr, true)) => format!("{expr}?"),
        (false, (expr, false)) => expr,
    }
}

fn op_functions(out: &mut String, schema: &OpSchema, doc: &str) -> Result<(), String> {
    let name = camel(&schema.name);
    let mut c_params = Vec::new();
    for arg in &schema.args {
        c_params.extend(params(arg).map_err(|e| format!("{}: {e}", schema.name))?);
    }
    match schema.written_count() {
        // The caller's list of output tensors, as many as the call returns.
        None => c_params.push(format!("{}: *const uniopTensorList", schema.return_name(0))),
        Some(n) => c_params
            .extend((schema.mutated().count()..n).map(|i| format!("{}: *mut uniopTensor", schema.output_name(i)))),
    }
    c_params.extend(["workspaceSize: *mut u64".into(), "executor: *mut *mut uniopExecutor".into()]);
    let read: Vec<&Arg> = schema.inputs().filter(|a| a.ty.mutated.is_none()).collect();
    // A fixed array of named tensors; the items of the op's one list argument; or, beside other
    // tensors, those items in their place among them.
    let is_list = |a: &Arg| a.ty.base == BaseType::TensorList;
    let inputs = match read.iter().find(|a| is_list(a)) {
        Some(list) if read.len() == 1 => format!("let inputs = list_items(F, \"{0}\", {0})?;", list.name),
        Some(_) => {
            let items: Vec<String> = read
                .iter()
                .map(|a| match is_list(a) {
                    true => format!("inputs.extend(list_items(F, \"{0}\", {0})?);", a.name),
                    false => format!("inputs.extend([(TensorName::Arg(\"{0}\"), {0})]);", a.name),
                })
                .collect();
            format!("let mut inputs = Vec::new();\n        {}", items.join("\n        "))
        }
        None => {
            let items: Vec<String> = read.iter().map(|a| format!("(\"{0}\", {0})", a.name)).collect();
            format!("let inputs: [(&str, *const uniopTensor); {}] = [{}];", items.len(), items.join(", "))
        }
    };
    let attrs: Vec<String> = schema.attrs().map(|a| format!("(\"{}\", {})", a.name, attr_value(a))).collect();
    let outputs = match schema.written_count() {
        None => format!("list_items(F, \"{0}\", {0})?", schema.return_name(0)),
        Some(n) => {
            let items: Vec<String> = (0..n)
                .map(|i| {
                    let n = schema.output_name(i);
                    format!("(\"{n}\", {n} as *const uniopTensor)")
                })
                .collect();
            format!("[{}]", items.join(", "))
        }
    };
    let doc_lines: String = textwrap(doc, 96).iter().map(|l| format!("/// {l}\n")).collect();
    let _ = write!(
        out,
        "/// Phase 1 of `{schema}`.\n///\n{doc_lines}#[no_mangle]\npub extern \"C\" fn uniop{name}GetWorkspaceSize(\n    {params},\n) -> uniopStatus {{\n    \
         const F: &str = \"uniop{name}GetWorkspaceSize\";\n    guard(|| {{\n        \
         {inputs}\n        \
         let attrs: [(&str, AttrValue); {na}] = [{attrs}];\n        let outputs = {outputs};\n        \
         plan(\"{op}\", F, &inputs, &attrs, &outputs, workspaceSize, executor)\n    }})\n}}\n\n\
         /// Phase 2 of `{op}`: launches the executor from `uniop{name}GetWorkspaceSize` on `stream`.\n#[no_mangle]\n\
         pub extern \"C\" fn uniop{name}(\n    workspace: *mut c_void,\n    workspaceSize: u64,\n    executor: *mut uniopExecutor,\n    stream: uniopStream,\n) -> uniopStatus {{\n    \
         uniopOpRun(workspace, workspaceSize, executor, stream)\n}}\n\n",
        schema = schema,
        params = c_params.join(",\n    "),
        inputs = inputs,
        na = attrs.len(),
        attrs = attrs.join(", "),
        outputs = outputs,
        op = schema.name,
    );
    Ok(())
}

/// Whether `word` at the start of a doc comment's line would make Markdown read the line as a
/// list item, a heading or a quote (`a * b` wrapped before `*`), which rustdoc renders as such and
/// clippy's `doc_lazy_continuation` rejects.
fn opens_block(word: &str) -> bool {
    let numbered =
        word.len() > 1 && word.ends_with(['.', ')']) && word[..word.len() - 1].chars().all(|c| c.is_ascii_digit());
    matches!(word, "*" | "-" | "+" | ">") || word.starts_with('#') || numbered
}

fn textwrap(text: &str, width: usize) -> Vec<String> {
    let mut lines = vec![String::new()];
    for word in text.split_whitespace() {
        let line = lines.last_mut().unwrap();
        // A word that would open a block stays on the line before, past the width.
        if !line.is_empty() && line.len() + 1 + word.len() > width && !opens_block(word) {
            lines.push(word.to_string());
        } else {
            if !line.is_empty() {
                line.push(' ');
            }
            line.push_str(word);
        }
    }
    lines
}

fn generate_ops() -> Result<String, String> {
    uniop_ops::init();
    let mut body = String::new();
    let mut entries = Registry::global().list();
    entries.sort_by(|a, b| a.name().cmp(b.name()));
    for entry in entries {
        op_functions(&mut body, &entry.schema, entry.op.doc())?;
    }
    // Import exactly what the functions use (an unused import would fail clippy).
    let mut tensor_items = vec!["plan", "uniopDataType", "uniopExecutor", "uniopOpRun", "uniopTensor"];
    for (used, item) in [
        ("list_items(", "list_items"),
        ("uniopTensorList", "uniopTensorList"),
        ("scalar_value(", "scalar_value"),
        ("uniopScalar", "uniopScalar"),
        ("int_array_value(", "int_array_value"),
        ("TensorName::", "TensorName"),
        ("uniopIntArray", "uniopIntArray"),
    ] {
        if body.contains(used) {
            tensor_items.push(item);
        }
    }
    Ok(format!(
        "// Generated by `cargo run -p uniop-capi --features header --bin uniop-header` from the op registry;\n\
         // do not edit. One typed two-phase pair per op, each a thin call into the generic plan.\n\n\
         use crate::runtime::uniopStream;\nuse crate::tensor::{{{}}};\n\
         use crate::{{guard, typed, uniopStatus}};\nuse std::ffi::{{c_char, c_void}};\nuse uniop::AttrValue;\n\n{body}",
        tensor_items.join(", ")
    ))
}

/// Formats generated Rust with the project's rustfmt settings (so `cargo fmt --check` agrees).
fn rustfmt(text: &str) -> Result<String, String> {
    use std::io::Write as _;
    use std::process::{Command, Stdio};
    let mut child = Command::new("rustfmt")
        .args(["--edition", "2021", "--emit", "stdout"])
        .current_dir(crate_dir().join("../.."))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("running rustfmt: {e}"))?;
    child.stdin.take().expect("piped").write_all(text.as_bytes()).map_err(|e| e.to_string())?;
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err("rustfmt failed on the generated ops".into());
    }
    String::from_utf8(out.stdout).map_err(|e| e.to_string())
}

fn generate_header() -> Result<String, String> {
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
    cbindgen::Builder::new()
        .with_crate(crate_dir())
        .with_config(config)
        .generate()
        .map_err(|e| e.to_string())?
        .write(&mut out);
    Ok(String::from_utf8(out).expect("cbindgen writes UTF-8"))
}

/// Writes `text` to `path`, or with `check` reports whether it already holds it.
fn emit(path: &Path, text: &str, check: bool) -> Result<(), String> {
    if check {
        if std::fs::read_to_string(path).unwrap_or_default() != text {
            return Err(format!(
                "{} is stale; regenerate it with `cargo run -p uniop-capi --features header --bin uniop-header`",
                path.display()
            ));
        }
        return Ok(());
    }
    std::fs::write(path, text).map_err(|e| format!("writing {}: {e}", path.display()))
}

fn main() -> ExitCode {
    let check = std::env::args().any(|a| a == "--check");
    // The ops file first: cbindgen reads it for the header.
    let result = generate_ops()
        .and_then(|ops| rustfmt(&ops))
        .and_then(|ops| emit(&crate_dir().join("src/ops.rs"), &ops, check))
        .and_then(|()| generate_header())
        .and_then(|h| emit(&crate_dir().join("../../include/uniop.h"), &h, check));
    match result {
        Ok(()) => {
            if check {
                println!("crates/uniop-capi/src/ops.rs and include/uniop.h are up to date");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("uniop-header: {e}");
            ExitCode::FAILURE
        }
    }
}
