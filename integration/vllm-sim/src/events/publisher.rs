//! The ZMQ side of a pod's KV events: vLLM's bind-or-connect rule, the
//! publisher that numbers and sends each step's batch, and the replay socket.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures_util::StreamExt;
use tokio::sync::mpsc;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use super::{encode_batch_with, HashEncoding, KvEvent, REPLAY_BUFFER_STEPS, REPLAY_END_SEQ};

/// How long one connect attempt of a connecting publisher may take.
const RECONNECT_ATTEMPT: std::time::Duration = std::time::Duration::from_secs(1);
/// Pause between connect attempts (libzmq's default reconnect interval is 100 ms).
const RECONNECT_INTERVAL: std::time::Duration = std::time::Duration::from_millis(200);

/// vLLM's rule: the publisher binds when the endpoint contains `*` or `::`
/// or is `ipc://` / `inproc://`; otherwise it connects.
pub fn should_bind(endpoint: &str) -> bool {
    endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://")
}

/// The endpoint pod `i` of this process uses. Connecting pods share the
/// endpoint (the subscriber binds); binding pods cannot share a port, so pod i
/// binds port + i (like vLLM's data-parallel rank offset), or `path-i` for ipc.
pub fn pod_endpoint(endpoint: &str, i: u16) -> String {
    if i == 0 || !should_bind(endpoint) {
        return endpoint.to_string();
    }
    if let Some(path) = endpoint.strip_prefix("ipc://") {
        return format!("ipc://{path}-{i}");
    }
    if let Some(pos) = endpoint.rfind(':') {
        if let Ok(port) = endpoint[pos + 1..].parse::<u32>() {
            return format!("{}:{}", &endpoint[..pos], port + u32::from(i));
        }
    }
    endpoint.to_string()
}

/// Converts a bind endpoint in vLLM syntax for the zeromq crate (`*` → 0.0.0.0).
fn bind_addr(endpoint: &str) -> String {
    endpoint.replace("tcp://*:", "tcp://0.0.0.0:")
}

/// Shared replay ring: `(seq, payload)` of the last REPLAY_BUFFER_STEPS batches.
pub type ReplayBuffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// Per-pod publisher state held by the engine: assigns sequence numbers,
/// keeps the replay buffer and hands encoded frames to the socket task.
pub struct Publisher {
    topic: Bytes,
    seq: u64,
    tx: Option<mpsc::UnboundedSender<ZmqMessage>>,
    replay: ReplayBuffer,
    encoding: HashEncoding,
}

impl Publisher {
    /// A publisher that only numbers batches (no socket): used when events are disabled and in tests.
    pub fn detached(topic: &str, encoding: HashEncoding) -> Self {
        Self {
            topic: Bytes::copy_from_slice(topic.as_bytes()),
            seq: 0,
            tx: None,
            replay: Arc::default(),
            encoding,
        }
    }

    pub fn replay_buffer(&self) -> ReplayBuffer {
        self.replay.clone()
    }

    /// Publishes one engine step's events (nothing when empty, as vLLM).
    pub fn publish(&mut self, events: Vec<KvEvent>) {
        if events.is_empty() {
            return;
        }
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        let payload = Bytes::from(encode_batch_with(ts, &events, 0, self.encoding));
        let seq = self.seq;
        self.seq += 1;
        {
            let mut buf = self.replay.lock().unwrap_or_else(|e| e.into_inner());
            if buf.len() >= REPLAY_BUFFER_STEPS {
                buf.pop_front();
            }
            buf.push_back((seq, payload.clone()));
        }
        if let Some(tx) = &self.tx {
            let frames = vec![
                self.topic.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload,
            ];
            if let Ok(msg) = ZmqMessage::try_from(frames) {
                let _ = tx.send(msg);
            }
        }
    }
}

/// Starts the PUB socket task (bind or connect by vLLM's rule) and returns the publisher.
/// Connecting never blocks the pod: batches published while no subscriber is
/// connected are dropped, as a PUB socket does. Like libzmq under vLLM, a
/// connecting publisher reconnects when its subscriber goes away (a restarted
/// indexer must get the events again).
pub async fn start_publisher(
    endpoint: String,
    topic: &str,
    encoding: HashEncoding,
) -> Result<Publisher, zeromq::ZmqError> {
    let (tx, mut rx) = mpsc::unbounded_channel::<ZmqMessage>();
    let mut opts = zeromq::SocketOptions::default();
    opts.connect_timeout(RECONNECT_ATTEMPT);
    let mut sock = zeromq::PubSocket::with_options(opts);
    let bind = should_bind(&endpoint);
    if bind {
        sock.bind(&bind_addr(&endpoint)).await?;
    }
    let mut monitor = sock.monitor();
    tokio::spawn(async move {
        let mut connected = bind;
        let mut retry = tokio::time::interval(RECONNECT_INTERVAL);
        loop {
            tokio::select! {
                msg = rx.recv() => {
                    let Some(msg) = msg else { break };
                    if connected {
                        if let Err(e) = sock.send(msg).await {
                            eprintln!("vllm-sim: kv-events send failed: {e}");
                        }
                    }
                }
                event = monitor.next() => {
                    if let Some(zeromq::SocketEvent::Disconnected(_)) = event {
                        connected = bind;
                    }
                }
                _ = retry.tick(), if !connected => {
                    match sock.connect(&endpoint).await {
                        Ok(()) => connected = true,
                        Err(e) => eprintln!("vllm-sim: kv-events connect to {endpoint} failed (retrying): {e}"),
                    }
                }
            }
        }
    });
    Ok(Publisher {
        topic: Bytes::copy_from_slice(topic.as_bytes()),
        seq: 0,
        tx: Some(tx),
        replay: Arc::default(),
        encoding,
    })
}

/// Serves vLLM's replay protocol on a ROUTER socket: a DEALER sends
/// `["", start_seq (8 B BE)]`; the answer is `["", topic, seq, payload]` for every
/// buffered batch with seq >= start, then `["", "", 0xFFFF_FFFF_FFFF_FFFF, ""]`.
pub async fn start_replay(
    endpoint: String,
    topic: String,
    replay: ReplayBuffer,
) -> Result<(), zeromq::ZmqError> {
    let mut sock = zeromq::RouterSocket::new();
    sock.bind(&bind_addr(&endpoint)).await?;
    tokio::spawn(async move {
        loop {
            let msg = match sock.recv().await {
                Ok(m) => m,
                Err(zeromq::ZmqError::NoMessage) => {
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
                Err(_) => continue,
            };
            let frames = msg.into_vec();
            // [identity, "", start_seq]
            if frames.len() < 3 || frames[2].len() != 8 {
                continue;
            }
            let identity = frames[0].clone();
            let mut be = [0u8; 8];
            be.copy_from_slice(&frames[2]);
            let start = u64::from_be_bytes(be);
            let batches: Vec<(u64, Bytes)> = {
                let buf = replay.lock().unwrap_or_else(|e| e.into_inner());
                buf.iter().filter(|(s, _)| *s >= start).cloned().collect()
            };
            let topic_b = Bytes::copy_from_slice(topic.as_bytes());
            for (seq, payload) in batches {
                let frames = vec![
                    identity.clone(),
                    Bytes::new(),
                    topic_b.clone(),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    payload,
                ];
                if let Ok(m) = ZmqMessage::try_from(frames) {
                    let _ = sock.send(m).await;
                }
            }
            let end = vec![
                identity,
                Bytes::new(),
                Bytes::new(),
                Bytes::copy_from_slice(&REPLAY_END_SEQ.to_be_bytes()),
                Bytes::new(),
            ];
            if let Ok(m) = ZmqMessage::try_from(end) {
                let _ = sock.send(m).await;
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bind_rule_and_pod_endpoints() {
        assert!(should_bind("tcp://*:5557"));
        assert!(should_bind("tcp://[::]:5557"));
        assert!(should_bind("ipc:///tmp/kv"));
        assert!(!should_bind("tcp://127.0.0.1:5557"));
        assert_eq!(pod_endpoint("tcp://*:5557", 2), "tcp://*:5559");
        assert_eq!(
            pod_endpoint("tcp://127.0.0.1:5557", 2),
            "tcp://127.0.0.1:5557"
        );
        assert_eq!(pod_endpoint("ipc:///tmp/kv", 1), "ipc:///tmp/kv-1");
        assert_eq!(bind_addr("tcp://*:5557"), "tcp://0.0.0.0:5557");
    }

    #[test]
    fn publisher_numbers_batches_and_bounds_replay() {
        let mut p = Publisher::detached("t", HashEncoding::Int);
        p.publish(vec![]);
        assert!(p.replay_buffer().lock().unwrap().is_empty());
        for _ in 0..3 {
            p.publish(vec![KvEvent::AllBlocksCleared]);
        }
        let seqs: Vec<u64> = p
            .replay_buffer()
            .lock()
            .unwrap()
            .iter()
            .map(|(s, _)| *s)
            .collect();
        assert_eq!(seqs, vec![0, 1, 2]);
    }
}
