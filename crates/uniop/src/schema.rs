//! Op schemas in PyTorch's schema language.
//!
//! One line such as `rms_norm(Tensor x, Tensor weight, float eps=1e-06) -> (Tensor y, Tensor rstd)`
//! is the single source of truth for an op's signature: torch accepts the same string in
//! `torch.library`, and every uniop frontend (C header generator, ORT/MindSpore/TF adapters, the CLI)
//! derives its inputs, attributes and outputs from the parsed [`OpSchema`]. Parse errors point at
//! the column, because schema typos are the first thing an op author hits.

use crate::dtype::DType;
use crate::error::{Error, ErrorCode, Result};
use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BaseType {
    Tensor,
    TensorList,
    Int,
    Float,
    Bool,
    Str,
    IntList,
    ScalarType,
    /// A number of any kind (torch's `Scalar`, aclnn's `aclScalar`): kept as given, so an integer
    /// stays exact for integer tensors.
    Scalar,
}

impl BaseType {
    fn spelling(self) -> &'static str {
        match self {
            BaseType::Tensor => "Tensor",
            BaseType::TensorList => "Tensor[]",
            BaseType::Int => "int",
            BaseType::Float => "float",
            BaseType::Bool => "bool",
            BaseType::Str => "str",
            BaseType::IntList => "int[]",
            BaseType::ScalarType => "ScalarType",
            BaseType::Scalar => "Scalar",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArgType {
    pub base: BaseType,
    pub optional: bool,
    /// The alias set of a tensor the op writes in place, as in torch's `Tensor(a!) cache`.
    pub mutated: Option<char>,
}

impl ArgType {
    /// Tensor-valued arguments are op inputs; everything else is an attribute.
    pub fn is_tensor(self) -> bool {
        matches!(self.base, BaseType::Tensor | BaseType::TensorList)
    }
}

impl fmt::Display for ArgType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.base.spelling())?;
        if let Some(set) = self.mutated {
            write!(f, "({set}!)")?;
        }
        write!(f, "{}", if self.optional { "?" } else { "" })
    }
}

/// A non-tensor argument value (attribute).
#[derive(Clone, Debug, PartialEq)]
pub enum AttrValue {
    None,
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    Ints(Vec<i64>),
    DType(DType),
}

impl AttrValue {
    /// Whether this value may be passed for an argument of type `ty` (ints widen to float).
    pub fn fits(&self, ty: ArgType) -> bool {
        match (self, ty.base) {
            (AttrValue::None, _) => ty.optional,
            (AttrValue::Int(_), BaseType::Int | BaseType::Float)
            | (AttrValue::Float(_), BaseType::Float)
            | (AttrValue::Bool(_), BaseType::Bool)
            | (AttrValue::Str(_), BaseType::Str)
            | (AttrValue::Ints(_), BaseType::IntList)
            | (AttrValue::DType(_), BaseType::ScalarType)
            | (AttrValue::Int(_) | AttrValue::Float(_) | AttrValue::Bool(_), BaseType::Scalar) => true,
            _ => false,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            AttrValue::None => "None",
            AttrValue::Int(_) => "int",
            AttrValue::Float(_) => "float",
            AttrValue::Bool(_) => "bool",
            AttrValue::Str(_) => "str",
            AttrValue::Ints(_) => "int[]",
            AttrValue::DType(_) => "ScalarType",
        }
    }
}

impl AttrValue {
    /// A value as a caller writes it outside a schema (`uniop run --attr`, the C API's attribute
    /// string): `True`/`False`, an int, a float, `[1, -2]`, else a string (binding turns a string
    /// into a dtype where the schema wants a `ScalarType`: "half" is a dtype or a RoPE mode).
    pub fn parse_literal(text: &str) -> AttrValue {
        let t = text.trim();
        match t {
            "True" | "true" => return AttrValue::Bool(true),
            "False" | "false" => return AttrValue::Bool(false),
            "None" => return AttrValue::None,
            _ => {}
        }
        if let Some(items) = t.strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
            let ints: std::result::Result<Vec<i64>, _> =
                items.split(',').map(str::trim).filter(|i| !i.is_empty()).map(str::parse).collect();
            if let Ok(ints) = ints {
                return AttrValue::Ints(ints);
            }
        }
        if let Ok(v) = t.parse::<i64>() {
            return AttrValue::Int(v);
        }
        if let Ok(v) = t.parse::<f64>() {
            return AttrValue::Float(v);
        }
        AttrValue::Str(t.to_string())
    }

    /// `name=value` pairs separated by commas outside brackets: `"eps=1e-5, dims=[0, 1]"`.
    pub fn parse_assignments(text: &str) -> Result<Vec<(String, AttrValue)>> {
        let mut pairs = Vec::new();
        let (mut depth, mut start) = (0usize, 0usize);
        let bytes = text.as_bytes();
        for i in 0..=bytes.len() {
            match bytes.get(i) {
                Some(b'[') => depth += 1,
                Some(b']') => depth = depth.saturating_sub(1),
                Some(b',') if depth > 0 => {}
                Some(b',') | None => {
                    let item = text[start..i].trim();
                    start = i + 1;
                    if item.is_empty() {
                        continue;
                    }
                    let (name, value) = item.split_once('=').ok_or_else(|| {
                        Error::new(ErrorCode::ParamInvalid, format!("attribute `{item}`: expected NAME=VALUE"))
                    })?;
                    pairs.push((name.trim().to_string(), AttrValue::parse_literal(value)));
                }
                _ => {}
            }
        }
        Ok(pairs)
    }
}

impl fmt::Display for AttrValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AttrValue::None => write!(f, "None"),
            AttrValue::Int(v) => write!(f, "{v}"),
            AttrValue::Float(v) => write!(f, "{v:?}"),
            AttrValue::Bool(v) => write!(f, "{}", if *v { "True" } else { "False" }),
            AttrValue::Str(v) => write!(f, "'{v}'"),
            AttrValue::Ints(v) => {
                let parts: Vec<String> = v.iter().map(|x| x.to_string()).collect();
                write!(f, "[{}]", parts.join(", "))
            }
            AttrValue::DType(d) => write!(f, "{d}"),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Arg {
    pub name: String,
    pub ty: ArgType,
    pub default: Option<AttrValue>,
    /// Declared after a bare `*`: keyword-only in Python frontends.
    pub kwarg_only: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Return {
    pub name: Option<String>,
    pub ty: ArgType,
}

#[derive(Clone, Debug, PartialEq)]
pub struct OpSchema {
    pub name: String,
    pub overload: Option<String>,
    pub args: Vec<Arg>,
    pub returns: Vec<Return>,
}

impl OpSchema {
    pub fn parse(text: &str) -> Result<OpSchema> {
        Parser { text, pos: 0 }.schema()
    }

    /// Tensor arguments (op inputs), in declaration order.
    pub fn inputs(&self) -> impl Iterator<Item = &Arg> {
        self.args.iter().filter(|a| a.ty.is_tensor())
    }

    /// Non-tensor arguments (attributes), in declaration order.
    pub fn attrs(&self) -> impl Iterator<Item = &Arg> {
        self.args.iter().filter(|a| !a.ty.is_tensor())
    }

    /// Tensor arguments in declaration order, each with how many of `n` tensors passed flat it
    /// takes: one, or for a `Tensor[]` what the other arguments leave. The `n` tensors stand for
    /// all tensor arguments with `with_in_place`, else only those the op reads (callers bind
    /// in-place arguments from elsewhere; those still come with a count of one). Every walk over
    /// flattened tensors (binding, naming a slot, finding the in-place ones) goes through this, so
    /// they agree on where a list's items are.
    pub fn tensor_args(&self, n: usize, with_in_place: bool) -> impl Iterator<Item = (&Arg, usize)> {
        let counted = self.inputs().filter(|a| with_in_place || a.ty.mutated.is_none()).count();
        let list_len = (n + 1).saturating_sub(counted);
        self.inputs().map(move |a| (a, if a.ty.base == BaseType::TensorList { list_len } else { 1 }))
    }

    /// Tensor arguments the op writes in place (`Tensor(a!)`), in declaration order. Callers
    /// bind them with the outputs, so these come first among the tensors the op writes.
    pub fn mutated(&self) -> impl Iterator<Item = &Arg> {
        self.inputs().filter(|a| a.ty.mutated.is_some())
    }

    /// Whether the op returns a list of tensors (`-> Tensor[] dtensors`, its only output), whose
    /// length each call's `infer` decides.
    pub fn returns_list(&self) -> bool {
        self.returns.first().is_some_and(|r| r.ty.base == BaseType::TensorList)
    }

    /// Number of tensors the op writes: its in-place arguments, then its returns; `None` for a
    /// list return, whose length each call decides.
    pub fn written_count(&self) -> Option<usize> {
        (!self.returns_list()).then(|| self.mutated().count() + self.returns.len())
    }

    /// Declared name of return `i`, or `out`/`out{i}` for an unnamed one.
    pub fn return_name(&self, i: usize) -> String {
        match &self.returns[i].name {
            Some(n) => n.clone(),
            None if self.returns.len() == 1 => "out".to_string(),
            None => format!("out{i}"),
        }
    }

    /// Name of written tensor `i` (in-place arguments first, then returns): the argument's or the
    /// return's name (see [`OpSchema::return_name`]); for a list return, its item (`dtensors[i]`).
    pub fn output_name(&self, i: usize) -> String {
        if let Some(arg) = self.mutated().nth(i) {
            return arg.name.clone();
        }
        if self.returns_list() {
            return format!("{}[{i}]", self.return_name(0));
        }
        self.return_name(i - self.mutated().count())
    }
}

impl fmt::Display for OpSchema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.name)?;
        if let Some(o) = &self.overload {
            write!(f, ".{o}")?;
        }
        write!(f, "(")?;
        let mut star_written = false;
        for (i, a) in self.args.iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            if a.kwarg_only && !star_written {
                write!(f, "*, ")?;
                star_written = true;
            }
            write!(f, "{} {}", a.ty, a.name)?;
            if let Some(d) = &a.default {
                write!(f, "={d}")?;
            }
        }
        write!(f, ") -> ")?;
        let single_unnamed = self.returns.len() == 1 && self.returns[0].name.is_none();
        if !single_unnamed {
            write!(f, "(")?;
        }
        for (i, r) in self.returns.iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(f, "{}", r.ty)?;
            if let Some(n) = &r.name {
                write!(f, " {n}")?;
            }
        }
        if !single_unnamed {
            write!(f, ")")?;
        }
        Ok(())
    }
}

struct Parser<'a> {
    text: &'a str,
    pos: usize,
}

impl<'a> Parser<'a> {
    fn error(&self, at: usize, msg: impl fmt::Display) -> Error {
        let col = self.text[..at.min(self.text.len())].chars().count() + 1;
        let caret = " ".repeat(col - 1) + "^";
        Error::new(ErrorCode::ParamInvalid, format!("schema error at column {col}: {msg}\n  {}\n  {caret}", self.text))
    }

    fn rest(&self) -> &'a str {
        &self.text[self.pos..]
    }

    fn skip_ws(&mut self) {
        let trimmed = self.rest().trim_start();
        self.pos = self.text.len() - trimmed.len();
    }

    fn peek(&mut self) -> Option<char> {
        self.skip_ws();
        self.rest().chars().next()
    }

    fn eat(&mut self, token: &str) -> bool {
        self.skip_ws();
        if self.rest().starts_with(token) {
            self.pos += token.len();
            true
        } else {
            false
        }
    }

    fn expect(&mut self, token: &str) -> Result<()> {
        if self.eat(token) {
            Ok(())
        } else {
            Err(self.error(self.pos, format!("expected `{token}`, found {}", self.found())))
        }
    }

    fn found(&self) -> String {
        match self.rest().chars().next() {
            None => "end of schema".to_string(),
            Some(_) => {
                let word: String = self.rest().chars().take_while(|c| !c.is_whitespace()).take(12).collect();
                format!("`{word}`")
            }
        }
    }

    fn ident(&mut self, what: &str) -> Result<&'a str> {
        self.skip_ws();
        let start = self.pos;
        let len: usize = self
            .rest()
            .char_indices()
            .take_while(|&(i, c)| c == '_' || c.is_ascii_alphabetic() || (i > 0 && c.is_ascii_digit()))
            .map(|(_, c)| c.len_utf8())
            .sum();
        if len == 0 {
            return Err(self.error(start, format!("expected {what}, found {}", self.found())));
        }
        self.pos += len;
        Ok(&self.text[start..self.pos])
    }

    fn schema(mut self) -> Result<OpSchema> {
        let name = self.ident("an op name")?.to_string();
        let overload = if self.eat(".") { Some(self.ident("an overload name")?.to_string()) } else { None };
        self.expect("(")?;
        let mut args: Vec<Arg> = Vec::new();
        let mut kwarg_only = false;
        if !self.eat(")") {
            loop {
                if self.eat("*") {
                    if kwarg_only {
                        return Err(self.error(self.pos - 1, "`*` may appear only once"));
                    }
                    kwarg_only = true;
                } else {
                    let start = self.pos;
                    let arg = self.arg(kwarg_only)?;
                    if args.iter().any(|a| a.name == arg.name) {
                        return Err(self.error(start, format!("duplicate argument name '{}'", arg.name)));
                    }
                    if let Some(set) = arg.ty.mutated.filter(|&c| args.iter().any(|a| a.ty.mutated == Some(c))) {
                        return Err(self.error(start, format!("alias set `{set}` is used twice")));
                    }
                    if arg.default.is_none()
                        && !arg.kwarg_only
                        && args.iter().any(|a| a.default.is_some() && !a.kwarg_only)
                    {
                        return Err(self.error(
                            start,
                            format!("argument '{}' without a default follows one with a default", arg.name),
                        ));
                    }
                    args.push(arg);
                }
                if self.eat(")") {
                    break;
                }
                self.expect(",")?;
            }
        }
        let arrow = self.pos;
        self.expect("->")?;
        let returns = if self.eat("(") {
            let mut rets = Vec::new();
            if !self.eat(")") {
                loop {
                    rets.push(self.ret()?);
                    if self.eat(")") {
                        break;
                    }
                    self.expect(",")?;
                }
            }
            rets
        } else {
            vec![self.ret()?]
        };
        self.skip_ws();
        if self.pos != self.text.len() {
            return Err(self.error(self.pos, format!("unexpected {} after the returns", self.found())));
        }
        // A list return's length is known only per call (from `infer`); alone, the tensors an op
        // writes are still numbered simply: item `i` of the list is written tensor `i`.
        let has_list = returns.iter().any(|r| r.ty.base == BaseType::TensorList);
        if has_list && (returns.len() > 1 || args.iter().any(|a| a.ty.mutated.is_some())) {
            return Err(self.error(
                arrow,
                "a `Tensor[]` return must be the op's only output (no other return, no in-place argument)",
            ));
        }
        Ok(OpSchema { name, overload, args, returns })
    }

    fn ty(&mut self) -> Result<ArgType> {
        let start = self.pos;
        let word = self.ident("a type")?;
        let mut base = match word {
            "Tensor" => BaseType::Tensor,
            "int" | "SymInt" => BaseType::Int,
            "float" => BaseType::Float,
            "bool" => BaseType::Bool,
            "str" => BaseType::Str,
            "ScalarType" => BaseType::ScalarType,
            "Scalar" => BaseType::Scalar,
            other => {
                return Err(self.error(
                    start,
                    format!("unknown type `{other}` (expected Tensor, Tensor?, Tensor[], int, float, bool, str, int[], Scalar or ScalarType)"),
                ))
            }
        };
        if self.rest().starts_with('[') {
            let bracket = self.pos;
            self.pos += 1;
            // `int[2]`: a fixed length is accepted and treated as a list.
            while self.rest().starts_with(|c: char| c.is_ascii_digit()) {
                self.pos += 1;
            }
            self.expect("]")?;
            base = match base {
                BaseType::Tensor => BaseType::TensorList,
                BaseType::Int => BaseType::IntList,
                _ => return Err(self.error(bracket, format!("lists of `{word}` are not supported"))),
            };
        }
        let mutated = if base == BaseType::Tensor && self.rest().starts_with('(') {
            let at = self.pos;
            self.pos += 1;
            let set = self.ident("an alias set such as `a`")?;
            let mut chars = set.chars();
            let (Some(c), None) = (chars.next(), chars.next()) else {
                return Err(self.error(at + 1, format!("alias sets are one letter, found `{set}`")));
            };
            if !self.rest().starts_with('!') {
                return Err(self.error(
                    self.pos,
                    "only in-place annotations `(a!)` are supported (ops never return views of their inputs)",
                ));
            }
            self.pos += 1;
            self.expect(")")?;
            Some(c)
        } else {
            None
        };
        let optional = self.rest().starts_with('?');
        if optional {
            if mutated.is_some() {
                return Err(self.error(self.pos, "an in-place tensor argument cannot be optional"));
            }
            self.pos += 1;
        }
        Ok(ArgType { base, optional, mutated })
    }

    fn arg(&mut self, kwarg_only: bool) -> Result<Arg> {
        let ty = self.ty()?;
        let name = self.ident("an argument name")?.to_string();
        let default = if self.eat("=") {
            let at = self.pos;
            let value = self.value()?;
            if ty.is_tensor() && value != AttrValue::None {
                return Err(self.error(at, format!("a tensor argument ('{name}') can only default to None")));
            }
            if !ty.is_tensor() && !value.fits(ty) {
                return Err(
                    self.error(at, format!("default {value} ({}) does not fit type {ty} of '{name}'", value.kind()))
                );
            }
            // Store int defaults of float args as floats so consumers see one representation.
            Some(match (value, ty.base) {
                (AttrValue::Int(v), BaseType::Float) => AttrValue::Float(v as f64),
                (v, _) => v,
            })
        } else {
            None
        };
        Ok(Arg { name, ty, default, kwarg_only })
    }

    fn ret(&mut self) -> Result<Return> {
        let start = self.pos;
        let ty = self.ty()?;
        let tensors = matches!(ty.base, BaseType::Tensor | BaseType::TensorList);
        if !tensors || ty.optional || ty.mutated.is_some() {
            return Err(self.error(start, format!("only `Tensor` or `Tensor[]` returns are supported, found `{ty}`")));
        }
        let name = match self.peek() {
            Some(c) if c.is_ascii_alphabetic() || c == '_' => Some(self.ident("a return name")?.to_string()),
            _ => None,
        };
        Ok(Return { name, ty })
    }

    fn value(&mut self) -> Result<AttrValue> {
        self.skip_ws();
        let start = self.pos;
        if self.eat("[") {
            let mut items = Vec::new();
            if !self.eat("]") {
                loop {
                    match self.value()? {
                        AttrValue::Int(v) => items.push(v),
                        other => return Err(self.error(start, format!("list defaults must hold ints, found {other}"))),
                    }
                    if self.eat("]") {
                        break;
                    }
                    self.expect(",")?;
                }
            }
            return Ok(AttrValue::Ints(items));
        }
        if let Some(q) = self.rest().chars().next().filter(|c| *c == '\'' || *c == '"') {
            let body = &self.rest()[1..];
            let end = body.find(q).ok_or_else(|| self.error(start, "unterminated string default"))?;
            let s = body[..end].to_string();
            self.pos += end + 2;
            return Ok(AttrValue::Str(s));
        }
        let len = self
            .rest()
            .find(|c: char| c == ',' || c == ')' || c == ']' || c.is_whitespace())
            .unwrap_or(self.rest().len());
        let word = &self.rest()[..len];
        let value = match word {
            "True" => AttrValue::Bool(true),
            "False" => AttrValue::Bool(false),
            "None" => AttrValue::None,
            _ => {
                if let Ok(v) = word.parse::<i64>() {
                    AttrValue::Int(v)
                } else if let Ok(v) = word.parse::<f64>() {
                    AttrValue::Float(v)
                } else if let Some(d) = word.strip_prefix("torch.").and_then(|d| DType::parse(d).ok()) {
                    AttrValue::DType(d)
                } else {
                    return Err(self.error(start, format!("cannot parse default value `{word}`")));
                }
            }
        };
        self.pos += len;
        Ok(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_rms_norm() {
        let s =
            OpSchema::parse("rms_norm(Tensor x, Tensor weight, float eps=1e-06) -> (Tensor y, Tensor rstd)").unwrap();
        assert_eq!(s.name, "rms_norm");
        assert_eq!(s.inputs().map(|a| a.name.as_str()).collect::<Vec<_>>(), ["x", "weight"]);
        let eps = s.attrs().next().unwrap();
        assert_eq!(eps.default, Some(AttrValue::Float(1e-6)));
        assert_eq!(s.returns.len(), 2);
        assert_eq!(s.output_name(1), "rstd");
    }

    #[test]
    fn parses_every_type_and_default() {
        let text = "f.ov(Tensor a, Tensor? b, Tensor[] c, int n, int[] dims=[1, -2], *, float alpha=1, bool flag=True, str mode='half', ScalarType? dtype=None, int k=-3) -> Tensor";
        let s = OpSchema::parse(text).unwrap();
        assert_eq!(s.overload.as_deref(), Some("ov"));
        assert_eq!(s.args[1].ty, ArgType { base: BaseType::Tensor, optional: true, mutated: None });
        assert_eq!(s.args[2].ty.base, BaseType::TensorList);
        assert_eq!(s.args[4].default, Some(AttrValue::Ints(vec![1, -2])));
        assert!(s.args[5].kwarg_only && !s.args[4].kwarg_only);
        assert_eq!(s.args[5].default, Some(AttrValue::Float(1.0)), "int default of a float arg becomes float");
        assert_eq!(s.args[7].default, Some(AttrValue::Str("half".into())));
        assert_eq!(s.args[9].default, Some(AttrValue::Int(-3)));
        assert_eq!(s.output_name(0), "out");
        // Display round-trips through the parser.
        let again = OpSchema::parse(&s.to_string()).unwrap();
        assert_eq!(again, s);
    }

    #[test]
    fn parses_caller_attribute_strings() {
        let got =
            AttrValue::parse_assignments("eps=1e-5, dims=[0, -1],causal=True,mode=half, dtype=bfloat16,n=3").unwrap();
        let want = [
            ("eps", AttrValue::Float(1e-5)),
            ("dims", AttrValue::Ints(vec![0, -1])),
            ("causal", AttrValue::Bool(true)),
            ("mode", AttrValue::Str("half".into())),
            ("dtype", AttrValue::Str("bfloat16".into())),
            ("n", AttrValue::Int(3)),
        ];
        assert_eq!(got, want.map(|(k, v)| (k.to_string(), v)));
        assert!(AttrValue::parse_assignments("").unwrap().is_empty());
        let e = AttrValue::parse_assignments("eps").unwrap_err();
        assert!(e.message().contains("expected NAME=VALUE"), "{e}");
    }

    #[test]
    fn parses_in_place_arguments() {
        let s = OpSchema::parse("append(Tensor(a!) cache, Tensor x, Tensor(b!) other) -> (Tensor n)").unwrap();
        assert_eq!(s.args[0].ty.mutated, Some('a'));
        assert_eq!(s.args[1].ty.mutated, None);
        assert_eq!(s.mutated().map(|a| a.name.as_str()).collect::<Vec<_>>(), ["cache", "other"]);
        assert_eq!(s.written_count(), Some(3));
        assert_eq!(
            (s.output_name(0), s.output_name(1), s.output_name(2)),
            ("cache".into(), "other".into(), "n".into())
        );
        assert_eq!(s.to_string(), "append(Tensor(a!) cache, Tensor x, Tensor(b!) other) -> (Tensor n)");
        assert_eq!(OpSchema::parse("f(Tensor(a!) c) -> ()").unwrap().written_count(), Some(1));
    }

    #[test]
    fn parses_a_list_return() {
        let s = OpSchema::parse("split(Tensor x, int[] sizes) -> Tensor[] parts").unwrap();
        assert!(s.returns_list());
        assert_eq!(s.written_count(), None);
        assert_eq!((s.return_name(0), s.output_name(2)), ("parts".into(), "parts[2]".into()));
        assert_eq!(OpSchema::parse(&s.to_string()).unwrap(), s, "{s}");
        assert!(!OpSchema::parse("f(Tensor[] x) -> Tensor").unwrap().returns_list());
    }

    #[test]
    fn errors_point_at_the_column() {
        let e = OpSchema::parse("add(Tensor a, Tnsor b) -> Tensor").unwrap_err();
        assert_eq!(e.code(), ErrorCode::ParamInvalid);
        assert!(e.message().starts_with("schema error at column 15: unknown type `Tnsor`"), "{e}");
        assert!(e.message().ends_with(&format!("\n  {}^", " ".repeat(14))), "{e}");

        let cases = [
            ("add(Tensor a, Tensor b -> Tensor", "expected `,`"),
            ("add(Tensor a) -> int", "only `Tensor` or `Tensor[]` returns"),
            ("add(Tensor a, float x='s') -> Tensor", "does not fit type float"),
            ("add(Tensor a, Tensor a) -> Tensor", "duplicate argument name 'a'"),
            ("add(Tensor a, float x=1.0, float y) -> Tensor", "without a default"),
            ("add(Tensor a) -> Tensor y z", "unexpected `z`"),
            ("add(Tensor a=1) -> Tensor", "can only default to None"),
            ("(Tensor a) -> Tensor", "expected an op name"),
            ("add(bool[] a) -> Tensor", "lists of `bool`"),
            ("f(Tensor(a) c) -> ()", "only in-place annotations"),
            ("f(Tensor(ab!) c) -> ()", "one letter"),
            ("f(Tensor(a!)? c) -> ()", "cannot be optional"),
            ("f(Tensor(a!) c, Tensor(a!) d) -> ()", "alias set `a` is used twice"),
            ("f(Tensor c) -> Tensor(a!)", "only `Tensor` or `Tensor[]` returns"),
            ("f(Tensor c) -> (Tensor[] a, Tensor b)", "must be the op's only output"),
            ("f(Tensor(a!) c) -> Tensor[] a", "must be the op's only output"),
            ("f(Tensor c) -> Tensor[]? a", "only `Tensor` or `Tensor[]` returns"),
        ];
        for (text, want) in cases {
            let e = OpSchema::parse(text).unwrap_err();
            assert!(e.message().contains(want), "{text}: {e}");
        }
    }
}
