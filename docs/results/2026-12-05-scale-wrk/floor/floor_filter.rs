//! The floor of a proxy-wasm filter in Envoy: what a filter that does no routing work costs.
//! Built with FLOOR_MODE=pass: every callback returns at once. Otherwise: requests are held
//! until their whole body is in, the body is read into the VM, and the destination header is
//! set to the first endpoint address of the (kvroute) plugin config.
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel, MetricType};
use std::rc::Rc;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root { mode: Rc::new(String::new()) }) });
}}

struct Root {
    mode: Rc<String>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let config = String::from_utf8(self.get_plugin_configuration().unwrap_or_default()).unwrap_or_default();
        let pod = config
            .split("\"address\"")
            .nth(1)
            .and_then(|rest| rest.split('"').nth(1))
            .unwrap_or_default();
        let mode = if option_env!("FLOOR_MODE") == Some("pass") { "pass".to_string() } else { format!("buffer:{pod}") };
        self.mode = Rc::new(mode);
        // What the benchmark harness waits for: serving peers, and a singleton's flush.
        if let Ok(id) = proxy_wasm::hostcalls::define_metric(MetricType::Gauge, "kvroute.peers") {
            let _ = proxy_wasm::hostcalls::record_metric(id, 64);
        }
        if let Ok(id) = proxy_wasm::hostcalls::define_metric(MetricType::Counter, "kvroute.index.flushed") {
            let _ = proxy_wasm::hostcalls::increment_metric(id, 1);
        }
        true
    }

    fn create_http_context(&self, _id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Request { mode: self.mode.clone(), holding: false }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Request {
    mode: Rc<String>,
    holding: bool,
}

impl Context for Request {}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        if self.mode.contains("pass") || end_of_stream {
            return Action::Continue;
        }
        self.holding = true;
        Action::Pause
    }

    fn on_http_request_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        if !self.holding {
            return Action::Continue;
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.holding = false;
        let body = self.get_http_request_body(0, size).unwrap_or_default();
        if !body.is_empty() {
            if let Some(pod) = self.mode.split("buffer:").nth(1) {
                self.set_http_request_header("x-gateway-destination-endpoint", Some(pod.trim()));
            }
        }
        Action::Continue
    }
}
