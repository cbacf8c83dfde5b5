//! `POST /v1/lookup`: the candidate pods for one prompt, for proxies that
//! hold no index (mesh sidecars). The proxy sends the prompt's kvroute block
//! hashes; the answer lists every pod holding a prefix of that chain (what
//! the feed would serve: precise tiers and learned entries) and a few
//! least-loaded pods, each with its reported load. The proxy ranks them
//! (kvroute_core::lookup::decide). Read-only, like `GET /v1/feed`.

use std::borrow::Cow;
use std::collections::HashSet;

use kvroute_core::hash::BlockHash;
use kvroute_core::lookup::{Candidate, HeldPrefix, LookupAnswer, LookupRequest};

use crate::index::{BuildMix, Index, Load, PodKey, PodView};

/// Pods holding a prefix that an answer lists at most: the longest prefixes
/// first. Past a few dozen, a shorter prefix loses to a longer one on the
/// prefill term unless its pod is far less loaded, and the least-loaded
/// pods are listed anyway.
pub const MAX_HOLDERS: usize = 32;

/// Least-loaded serving pods (waiting + running, then KV usage) an answer
/// adds besides the holders: where a prompt nobody holds should go.
pub const LEAST_LOADED: usize = 4;

/// Largest request body: `max_blocks` (at most 65,536) hashes of up to 20 digits.
pub const MAX_BODY_BYTES: usize = 2 << 20;

/// Hashes one request may carry (the filter's `max_blocks` bound).
const MAX_HASHES: usize = 1 << 16;

/// Decodes a request body; the error says what is wrong.
pub fn parse_request(body: &[u8]) -> Result<LookupRequest<'_>, String> {
    let request: LookupRequest =
        serde_json::from_slice(body).map_err(|e| format!("bad lookup request: {e}"))?;
    if request.model.is_empty() {
        return Err("bad lookup request: model is empty".into());
    }
    if request.hashes.len() > MAX_HASHES {
        return Err(format!(
            "bad lookup request: {} hashes > {MAX_HASHES}",
            request.hashes.len()
        ));
    }
    Ok(request)
}

/// The candidates for `request`: holders, longest prefix first (at most
/// [`MAX_HOLDERS`]), then up to [`LEAST_LOADED`] pods that hold none, taken
/// from the index's load order: the cost is the holders and a walk of
/// (holders + [`LEAST_LOADED`]) pods at most, not the fleet.
pub fn lookup(index: &Index, request: &LookupRequest<'_>) -> LookupAnswer {
    let mut holders = index.held_prefixes(&request.model, &request.hashes);
    let busy = |l: &Load| (l.waiting.saturating_add(l.running), l.kv_usage);
    let less_loaded = |a: &Load, b: &Load| {
        let (qa, ka) = busy(a);
        let (qb, kb) = busy(b);
        qa.cmp(&qb).then(ka.total_cmp(&kb))
    };
    holders.sort_unstable_by(|(a, ha), (b, hb)| {
        (hb.blocks, hb.gpu_blocks)
            .cmp(&(ha.blocks, ha.gpu_blocks))
            .then(less_loaded(a.load, b.load))
    });
    let holding: HashSet<PodKey, BuildMix> = holders.iter().map(|(pod, _)| pod.key).collect();
    holders.truncate(MAX_HOLDERS);
    let others = index
        .serving_by_load(&request.model)
        .filter(|pod| !holding.contains(&pod.key))
        .take(LEAST_LOADED);
    let candidate = |pod: PodView<'_>, held: HeldPrefix| Candidate {
        address: pod.address.to_owned(),
        held,
        waiting: pod.load.waiting,
        running: pod.load.running,
        kv_usage: pod.load.kv_usage,
        capacity_blocks: pod.load.capacity_blocks,
        speed: (pod.speed > 0.0).then_some(pod.speed),
    };
    let mut candidates: Vec<Candidate> = holders
        .into_iter()
        .map(|(pod, held)| candidate(pod, held))
        .collect();
    candidates.extend(others.map(|pod| candidate(pod, HeldPrefix::default())));
    LookupAnswer { candidates }
}

/// A request for `model` and `hashes` (tests and benchmarks).
pub fn request<'a>(model: &'a str, hashes: &'a [BlockHash]) -> LookupRequest<'a> {
    LookupRequest {
        model: Cow::Borrowed(model),
        hashes: Cow::Borrowed(hashes),
    }
}
