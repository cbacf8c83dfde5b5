//! Events in: each SUB socket feeds one bounded queue, one applier task
//! owns the write path, and gaps are filled from the pods' replay sockets.

use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use super::Shared;
use crate::index::{Incoming, ReplayRequest};
use crate::vllm_wire::decode_seq;

pub(super) enum Msg {
    Event(Incoming),
    ReplayDone(ReplayRequest, Result<Vec<(u64, Vec<u8>)>, String>),
}

/// Receives from one SUB socket into the bounded queue; drops (counted) when full.
pub(super) async fn receive(
    mut sock: SubSocket,
    identity: Option<(String, String)>,
    tx: mpsc::Sender<Msg>,
    shared: Shared,
) {
    loop {
        let msg = match sock.recv().await {
            Ok(m) => m,
            Err(_) => {
                // A peer went away (or nothing is connected yet); keep receiving.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let received_ms = shared.now_ms();
        let mut frames = msg.into_vec();
        if frames.len() != 3 {
            shared.metrics.messages_received.inc();
            shared.metrics.decode_error("frame_count");
            continue;
        }
        let payload = frames.pop().map(|b| b.to_vec()).unwrap_or_default();
        let seq = frames.pop().map(|b| b.to_vec()).unwrap_or_default();
        let topic = frames.pop().map(|b| b.to_vec()).unwrap_or_default();
        let incoming = Incoming {
            topic,
            seq,
            payload,
            identity: identity.clone(),
            received_ms,
        };
        match tx.try_send(Msg::Event(incoming)) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => {
                shared.metrics.messages_received.inc();
                shared.metrics.dropped("queue_full", 1);
            }
            Err(mpsc::error::TrySendError::Closed(_)) => return,
        }
    }
}

/// The single writer: applies queued messages in batches under one lock.
pub(super) async fn apply_loop(
    mut rx: mpsc::Receiver<Msg>,
    tx: mpsc::Sender<Msg>,
    shared: Shared,
    replay_timeout_ms: u64,
    capacity: usize,
) {
    let mut batch = Vec::with_capacity(256);
    loop {
        if rx.recv_many(&mut batch, 256).await == 0 {
            return;
        }
        let mut replays = Vec::new();
        {
            let mut ix = shared.lock();
            let now = shared.now_ms();
            for m in batch.drain(..) {
                match m {
                    Msg::Event(inc) => {
                        if let Some(req) = ix.handle(&inc, now) {
                            replays.push(req);
                        }
                    }
                    Msg::ReplayDone(req, result) => ix.finish_replay(&req, result, now),
                }
            }
        }
        shared
            .metrics
            .queue_depth
            .set(i64::try_from(capacity.saturating_sub(tx.capacity())).unwrap_or(0));
        for req in replays {
            let tx = tx.clone();
            let metrics = shared.metrics.clone();
            tokio::spawn(async move {
                let timeout = Duration::from_millis(replay_timeout_ms.max(1));
                let result = match tokio::time::timeout(
                    timeout,
                    replay(&req.endpoint, req.from_seq),
                )
                .await
                {
                    Ok(r) => r,
                    Err(_) => {
                        metrics.replay("timeout");
                        Err("timeout".to_owned())
                    }
                };
                let _ = tx.send(Msg::ReplayDone(req, result)).await;
            });
        }
    }
}

/// One replay exchange with a vLLM replay ROUTER: send `["", start_seq]`,
/// read `["", topic, seq, payload]` (≥ 0.26) or `["", seq, payload]` (≤ 0.20)
/// until the end marker (seq = 2^64-1).
pub async fn replay(endpoint: &str, from_seq: u64) -> Result<Vec<(u64, Vec<u8>)>, String> {
    let mut sock = DealerSocket::new();
    sock.connect(endpoint).await.map_err(|e| e.to_string())?;
    let request = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&from_seq.to_be_bytes()),
    ])
    .map_err(|e| e.to_string())?;
    sock.send(request).await.map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    loop {
        let msg = sock.recv().await.map_err(|e| e.to_string())?;
        let frames = msg.into_vec();
        let (seq, payload) = match frames.len() {
            4 => (&frames[2], &frames[3]),
            3 => (&frames[1], &frames[2]),
            n => return Err(format!("replay reply of {n} frames")),
        };
        let seq = decode_seq(seq).map_err(|e| e.to_string())?;
        if seq == u64::MAX {
            return Ok(out);
        }
        out.push((seq, payload.to_vec()));
    }
}
