//! The op registry: the only thing frontends know about ops.
//!
//! Ops register once (built-ins at start, plugins when loaded); each entry keeps the op and its
//! parsed schema. Lookups hand out `Arc`s so an executor keeps its op alive even if a plugin
//! unregisters later.

use crate::error::{Error, ErrorCode, Result};
use crate::op::Op;
use crate::schema::OpSchema;
use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock, RwLock};

pub struct OpEntry {
    pub op: Box<dyn Op>,
    pub schema: OpSchema,
}

impl OpEntry {
    pub fn name(&self) -> &str {
        &self.schema.name
    }
}

#[derive(Default)]
pub struct Registry {
    ops: RwLock<BTreeMap<String, Arc<OpEntry>>>,
}

impl Registry {
    pub fn new() -> Registry {
        Registry::default()
    }

    /// The process-wide registry every frontend reads.
    pub fn global() -> &'static Registry {
        static GLOBAL: OnceLock<Registry> = OnceLock::new();
        GLOBAL.get_or_init(Registry::new)
    }

    /// Parses the op's schema and adds it. Errors on a bad schema or a duplicate name.
    pub fn register(&self, op: Box<dyn Op>) -> Result<()> {
        let schema = OpSchema::parse(op.schema())?;
        let mut ops = self.ops.write().unwrap();
        if ops.contains_key(&schema.name) {
            return Err(Error::invalid(format!("op '{}' is already registered", schema.name)));
        }
        ops.insert(schema.name.clone(), Arc::new(OpEntry { op, schema }));
        Ok(())
    }

    pub fn get(&self, name: &str) -> Result<Arc<OpEntry>> {
        let ops = self.ops.read().unwrap();
        ops.get(name).cloned().ok_or_else(|| {
            let near: Vec<&str> =
                ops.keys().map(String::as_str).filter(|k| k.contains(name) || name.contains(*k)).collect();
            let hint = if near.is_empty() {
                format!("registered: {}", ops.keys().map(String::as_str).collect::<Vec<_>>().join(", "))
            } else {
                format!("did you mean: {}", near.join(", "))
            };
            Error::new(ErrorCode::ParamInvalid, format!("unknown op '{name}' ({hint})"))
        })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.ops.read().unwrap().contains_key(name)
    }

    /// All entries, sorted by name.
    pub fn list(&self) -> Vec<Arc<OpEntry>> {
        self.ops.read().unwrap().values().cloned().collect()
    }
}
