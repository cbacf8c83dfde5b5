//! kvroute.wasm: prefix-aware LLM routing as a proxy-wasm filter.
//!
//! Host calls live in `host`; everything they feed is pure logic from
//! `kvroute-core`. One module serves two roles, chosen by the plugin
//! configuration: the HTTP filter in every worker, and the singleton that
//! polls the indexer.

mod filter;
mod host;
mod load_sum;
mod metrics;
mod peers;
mod remote;
mod singleton;
mod ticker;
mod worker;

use kvroute_core::config::{Config, Role};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};
use std::cell::RefCell;
use std::rc::Rc;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Trace);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::Unconfigured) });
}}

thread_local! {
    /// The routing state of this VM. A configuration update creates a new root
    /// context in the same VM; it adopts this state, so the index survives.
    static WORKER: RefCell<Option<worker::SharedWorker>> = const { RefCell::new(None) };
}

/// This VM's worker, reconfigured; started on first use.
fn worker_of_this_vm(config: Rc<Config>, vm_id: &str) -> worker::SharedWorker {
    WORKER.with(|slot| {
        let mut slot = slot.borrow_mut();
        match slot.as_ref() {
            Some(existing) => {
                if let Ok(mut w) = existing.try_borrow_mut() {
                    w.reconfigure(config);
                    // The queue's callbacks go to the root context that
                    // registered it last; the old one may be draining away.
                    w.peers.reclaim_queue();
                }
                existing.clone()
            }
            None => {
                let started = Rc::new(RefCell::new(worker::Worker::start(config, vm_id)));
                *slot = Some(started.clone());
                started
            }
        }
    })
}

enum Root {
    Unconfigured,
    Filter(worker::SharedWorker),
    Singleton(Box<singleton::Singleton>),
}

impl Context for Root {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        if let Root::Singleton(s) = self {
            s.on_http_call_response(token_id, num_headers, body_size);
        }
    }
}

impl RootContext for Root {
    /// Refuses a bad configuration (Envoy then rejects the plugin) with a
    /// log line naming the field.
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let raw = host::plugin_configuration().unwrap_or_default();
        let config = match Config::from_json(&raw) {
            Ok(c) => Rc::new(c),
            Err(e) => {
                host::log(LogLevel::Error, &e.to_string());
                return false;
            }
        };
        let vm_id = host::property(&["plugin_vm_id"]).unwrap_or_default();
        match (std::mem::replace(self, Root::Unconfigured), config.role) {
            (Root::Filter(worker), Role::Filter) => {
                if let Ok(mut w) = worker.try_borrow_mut() {
                    w.reconfigure(config);
                }
                *self = Root::Filter(worker);
            }
            (Root::Singleton(mut s), Role::Singleton) => {
                let adopted = s.reconfigure(config);
                *self = Root::Singleton(s);
                if let Err(e) = adopted {
                    host::log(LogLevel::Error, &e);
                    return false;
                }
            }
            (_, Role::Filter) => {
                let endpoints = config.endpoints.len();
                *self = Root::Filter(worker_of_this_vm(config, &vm_id));
                host::set_tick_period(worker::DUTY_TICK_MS);
                host::log(
                    LogLevel::Info,
                    &format!("kvroute: filter configured (vm_id {vm_id:?}, {endpoints} endpoints)"),
                );
            }
            (_, Role::Singleton) => {
                let singleton = match singleton::Singleton::start(config, &vm_id) {
                    Ok(s) => s,
                    Err(e) => {
                        host::log(LogLevel::Error, &e);
                        return false;
                    }
                };
                *self = Root::Singleton(Box::new(singleton));
                host::log(
                    LogLevel::Info,
                    &format!("kvroute: singleton configured (vm_id {vm_id:?})"),
                );
            }
        }
        true
    }

    fn on_tick(&mut self) {
        match self {
            Root::Filter(worker) => {
                if let Ok(mut w) = worker.try_borrow_mut() {
                    w.on_tick();
                }
            }
            Root::Singleton(s) => s.on_tick(),
            Root::Unconfigured => {}
        }
    }

    fn on_queue_ready(&mut self, _queue_id: u32) {
        match self {
            Root::Filter(worker) => {
                if let Ok(mut w) = worker.try_borrow_mut() {
                    w.drain_queue();
                }
            }
            Root::Singleton(s) => s.drain_queue(),
            Root::Unconfigured => {}
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        match self {
            Root::Filter(worker) => {
                if let Ok(mut w) = worker.try_borrow_mut() {
                    w.serve();
                }
                Some(Box::new(filter::RequestFilter::new(worker.clone())))
            }
            _ => None,
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
