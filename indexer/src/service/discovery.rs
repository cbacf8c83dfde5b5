//! Pods and their load: the pods' `/metrics` scraped for queue, running
//! and KV use, and headless Services resolved into pods.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use super::Shared;
use crate::config::PodSource;
use crate::index::{origin, Index};
use crate::scrape::parse_vllm_metrics;

fn http_client() -> Client<hyper_util::client::legacy::connect::HttpConnector, Empty<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

pub(super) async fn scrape_loop(
    shared: Shared,
    interval: Duration,
    timeout: Duration,
    path: String,
) {
    let client = http_client();
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let pods: Vec<String> = shared
            .lock()
            .pod_addresses()
            .into_iter()
            .map(|(a, _)| a)
            .collect();
        let mut tasks = tokio::task::JoinSet::new();
        for address in pods {
            let client = client.clone();
            let path = path.clone();
            tasks.spawn(async move {
                let r = tokio::time::timeout(timeout, scrape(&client, &address, &path)).await;
                (address, r.ok().flatten())
            });
        }
        while let Some(done) = tasks.join_next().await {
            let Ok((address, load)) = done else { continue };
            shared.metrics.scrapes.inc();
            match load {
                Some(load) => {
                    let now = shared.now_ms();
                    shared.lock().set_load(&address, load, now);
                }
                None => {
                    shared.metrics.scrape_errors.inc();
                }
            }
        }
    }
}

async fn scrape(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Empty<Bytes>>,
    address: &str,
    path: &str,
) -> Option<crate::index::Load> {
    let uri: hyper::Uri = format!("http://{address}{path}").parse().ok()?;
    let resp = client.get(uri).await.ok()?;
    if !resp.status().is_success() {
        return None;
    }
    let body = Limited::new(resp.into_body(), 16 << 20)
        .collect()
        .await
        .ok()?
        .to_bytes();
    parse_vllm_metrics(std::str::from_utf8(&body).ok()?)
}

/// Adds the pod at `address` that `source` names (itself, or a record of its
/// Service), with the source's model (else `default_model`) and speed.
pub(super) fn add_source_pod(
    index: &mut Index,
    source: &PodSource,
    address: &str,
    default_model: &Option<String>,
    origin: u8,
    now_ms: u64,
) {
    let model = source.model.as_deref().or(default_model.as_deref());
    index.add_pod(address, model, origin, now_ms);
    if let Some(speed) = source.speed {
        index.set_speed(address, speed);
    }
}

/// Resolves every headless Service each `interval`: a record new to DNS
/// becomes a pod with its Service's model and speed, a pod no Service
/// resolves to any more loses its DNS origin. A Service whose resolution
/// fails keeps its last records.
pub(super) async fn dns_loop(
    shared: Shared,
    services: Vec<PodSource>,
    default_model: Option<String>,
    interval: Duration,
) {
    let mut tick = tokio::time::interval(interval);
    let mut records: Vec<Option<HashSet<String>>> = vec![None; services.len()];
    loop {
        tick.tick().await;
        for (service, last) in services.iter().zip(records.iter_mut()) {
            let name = service.address.as_str();
            match tokio::net::lookup_host(name).await {
                Ok(addrs) => *last = Some(addrs.map(|a| a.to_string()).collect()),
                Err(e) => {
                    eprintln!("kvroute-indexer: DNS {name}: {e}");
                    shared.metrics.rejected("dns_error");
                }
            }
        }
        let now = shared.now_ms();
        let mut ix = shared.lock();
        let known: HashMap<String, u8> = ix.pod_addresses().into_iter().collect();
        let mut resolved = HashSet::new();
        for (service, last) in services.iter().zip(&records) {
            for address in last.iter().flatten() {
                if known.get(address).is_none_or(|o| o & origin::DNS == 0)
                    && !resolved.contains(address)
                {
                    add_source_pod(&mut ix, service, address, &default_model, origin::DNS, now);
                }
                resolved.insert(address.clone());
            }
        }
        for (address, origins) in known {
            if origins & origin::DNS != 0 && !resolved.contains(&address) {
                ix.remove_origin(&address, origin::DNS);
            }
        }
    }
}
