//! kvroute.wasm: the proxy-wasm filter. Host calls live here; logic in kvroute-core.
