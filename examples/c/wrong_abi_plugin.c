/* A shared library that claims to be a uniop op library of another plugin ABI version: loading
 * it must fail with a clear error before any Rust-ABI symbol is used. */
unsigned uniop_plugin_abi_version(void) { return 999; }
