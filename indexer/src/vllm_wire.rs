//! Encoder of vLLM KV-event payloads (msgpack), both encodings. Used by the
//! benchmark and the tests to produce traffic shaped like vLLM's publisher
//! (the decoder in `kvroute_core::events` is checked against real captures).

use kvroute_core::events::{BlockRemoved, BlockStored, EventBatch, KvEvent, Medium};

/// Which event encoding to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// vLLM ≥ 0.26: events are maps.
    Map,
    /// vLLM ≤ 0.20: events are positional arrays.
    Array,
}

/// How block hashes are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HashForm {
    /// uint64 (vLLM default).
    Uint,
    /// 32-byte bin whose last 8 bytes are the hash (big-endian).
    Bin32,
}

struct W<'a>(&'a mut Vec<u8>);

impl W<'_> {
    fn len_marker(&mut self, n: usize, fix: u8, fix_max: usize, m16: u8, m32: u8) {
        if n <= fix_max {
            self.0.push(fix | n as u8);
        } else if let Ok(v) = u16::try_from(n) {
            self.0.push(m16);
            self.0.extend_from_slice(&v.to_be_bytes());
        } else {
            self.0.push(m32);
            self.0
                .extend_from_slice(&u32::try_from(n).unwrap_or(u32::MAX).to_be_bytes());
        }
    }
    fn arr(&mut self, n: usize) {
        self.len_marker(n, 0x90, 15, 0xdc, 0xdd);
    }
    fn map(&mut self, n: usize) {
        self.len_marker(n, 0x80, 15, 0xde, 0xdf);
    }
    fn str(&mut self, s: &str) {
        if s.len() < 32 {
            self.0.push(0xa0 | s.len() as u8);
        } else if let Ok(n) = u8::try_from(s.len()) {
            self.0.push(0xd9);
            self.0.push(n);
        } else {
            self.0.push(0xdb);
            self.0
                .extend_from_slice(&u32::try_from(s.len()).unwrap_or(u32::MAX).to_be_bytes());
        }
        self.0.extend_from_slice(s.as_bytes());
    }
    fn nil(&mut self) {
        self.0.push(0xc0);
    }
    fn uint(&mut self, v: u64) {
        if v < 128 {
            self.0.push(v as u8);
        } else if let Ok(x) = u8::try_from(v) {
            self.0.extend_from_slice(&[0xcc, x]);
        } else if let Ok(x) = u16::try_from(v) {
            self.0.push(0xcd);
            self.0.extend_from_slice(&x.to_be_bytes());
        } else if let Ok(x) = u32::try_from(v) {
            self.0.push(0xce);
            self.0.extend_from_slice(&x.to_be_bytes());
        } else {
            self.0.push(0xcf);
            self.0.extend_from_slice(&v.to_be_bytes());
        }
    }
    fn int(&mut self, v: i64) {
        if v >= 0 {
            self.uint(v as u64);
        } else {
            self.0.push(0xd3);
            self.0.extend_from_slice(&v.to_be_bytes());
        }
    }
    fn hash(&mut self, h: u64, form: HashForm) {
        match form {
            HashForm::Uint => {
                self.0.push(0xcf);
                self.0.extend_from_slice(&h.to_be_bytes());
            }
            HashForm::Bin32 => {
                self.0.extend_from_slice(&[0xc4, 32]);
                self.0.extend_from_slice(&[0x5a; 24]);
                self.0.extend_from_slice(&h.to_be_bytes());
            }
        }
    }
    fn hashes(&mut self, hs: &[u64], form: HashForm) {
        self.arr(hs.len());
        for &h in hs {
            self.hash(h, form);
        }
    }
    fn opt_hash(&mut self, h: Option<u64>, form: HashForm) {
        match h {
            Some(h) => self.hash(h, form),
            None => self.nil(),
        }
    }
    fn opt_int(&mut self, v: Option<i64>) {
        match v {
            Some(v) => self.int(v),
            None => self.nil(),
        }
    }
    fn opt_str(&mut self, v: Option<&str>) {
        match v {
            Some(v) => self.str(v),
            None => self.nil(),
        }
    }
    fn medium(&mut self, m: Option<&Medium>) {
        match m {
            None => self.nil(),
            Some(Medium::Gpu) => self.str("GPU"),
            Some(Medium::Cpu) => self.str("CPU"),
            Some(Medium::Other(s)) => self.str(s),
        }
    }
    fn tokens(&mut self, t: &[u32]) {
        self.arr(t.len());
        for &x in t {
            self.uint(u64::from(x));
        }
    }
}

/// Encodes a batch as vLLM's publisher would.
pub fn encode_batch(batch: &EventBatch, enc: Encoding, form: HashForm) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + batch.events.len() * 64);
    let mut w = W(&mut out);
    w.arr(if batch.data_parallel_rank.is_some() {
        3
    } else {
        2
    });
    w.0.push(0xcb);
    w.0.extend_from_slice(&batch.ts.to_bits().to_be_bytes());
    w.arr(batch.events.len());
    for ev in &batch.events {
        match (ev, enc) {
            (KvEvent::BlockStored(e), Encoding::Map) => stored_map(&mut w, e, form),
            (KvEvent::BlockStored(e), Encoding::Array) => stored_array(&mut w, e, form),
            (KvEvent::BlockRemoved(e), Encoding::Map) => removed_map(&mut w, e, form),
            (KvEvent::BlockRemoved(e), Encoding::Array) => {
                w.arr(4);
                w.str("BlockRemoved");
                w.hashes(&e.block_hashes, form);
                w.medium(e.medium.as_ref());
                w.opt_int(e.group_idx);
            }
            (KvEvent::AllBlocksCleared, Encoding::Map) => {
                w.map(1);
                w.str("type");
                w.str("AllBlocksCleared");
            }
            (KvEvent::AllBlocksCleared, Encoding::Array) => {
                w.arr(1);
                w.str("AllBlocksCleared");
            }
            (KvEvent::Unknown { tag }, Encoding::Map) => {
                w.map(1);
                w.str("type");
                w.str(tag);
            }
            (KvEvent::Unknown { tag }, Encoding::Array) => {
                w.arr(1);
                w.str(tag);
            }
        }
    }
    if let Some(r) = batch.data_parallel_rank {
        w.int(r);
    }
    out
}

fn stored_map(w: &mut W<'_>, e: &BlockStored, form: HashForm) {
    w.map(9);
    w.str("type");
    w.str("BlockStored");
    w.str("block_hashes");
    w.hashes(&e.block_hashes, form);
    w.str("parent_block_hash");
    w.opt_hash(e.parent_block_hash, form);
    w.str("token_ids");
    w.tokens(&e.token_ids);
    w.str("block_size");
    w.uint(u64::from(e.block_size));
    w.str("lora_id");
    w.opt_int(e.lora_id);
    w.str("medium");
    w.medium(e.medium.as_ref());
    w.str("lora_name");
    w.opt_str(e.lora_name.as_deref());
    w.str("group_idx");
    w.opt_int(e.group_idx);
}

fn stored_array(w: &mut W<'_>, e: &BlockStored, form: HashForm) {
    w.arr(10);
    w.str("BlockStored");
    w.hashes(&e.block_hashes, form);
    w.opt_hash(e.parent_block_hash, form);
    w.tokens(&e.token_ids);
    w.uint(u64::from(e.block_size));
    w.opt_int(e.lora_id);
    w.medium(e.medium.as_ref());
    w.opt_str(e.lora_name.as_deref());
    w.nil(); // extra_keys
    w.opt_int(e.group_idx);
}

fn removed_map(w: &mut W<'_>, e: &BlockRemoved, form: HashForm) {
    w.map(4);
    w.str("type");
    w.str("BlockRemoved");
    w.str("block_hashes");
    w.hashes(&e.block_hashes, form);
    w.str("medium");
    w.medium(e.medium.as_ref());
    w.str("group_idx");
    w.opt_int(e.group_idx);
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::events::decode_batch;

    #[test]
    fn roundtrips_through_the_core_decoder() {
        let batch = EventBatch {
            ts: 1.25,
            events: vec![
                KvEvent::BlockStored(BlockStored {
                    block_hashes: vec![u64::MAX, 3],
                    parent_block_hash: Some(1 << 40),
                    token_ids: (0..32).map(|i| i * 1000).collect(),
                    block_size: 16,
                    lora_id: Some(-1),
                    medium: Some(Medium::Cpu),
                    lora_name: Some("a-rather-long-lora-name-of-40-bytes-xxxx".into()),
                    group_idx: Some(0),
                }),
                KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: (0..20).collect(),
                    medium: Some(Medium::Other("DISK".into())),
                    group_idx: None,
                }),
                KvEvent::AllBlocksCleared,
            ],
            data_parallel_rank: Some(1),
        };
        for enc in [Encoding::Map, Encoding::Array] {
            for form in [HashForm::Uint, HashForm::Bin32] {
                let bytes = encode_batch(&batch, enc, form);
                assert_eq!(decode_batch(&bytes), Ok(batch.clone()), "{enc:?} {form:?}");
            }
        }
    }
}
