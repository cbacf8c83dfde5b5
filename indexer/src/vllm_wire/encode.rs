//! An encoder of the shapes vLLM publishes, in either event encoding, for
//! tests, benchmarks and the simulated pods' golden checks.

use kvroute_core::hash::ExtraKey;

use super::{EventBatch, KvEvent, Medium};

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

/// Writes msgpack into a Vec, which cannot fail.
struct Writer<'a> {
    out: &'a mut Vec<u8>,
    form: HashForm,
}

// `rmp::encode` reports write errors of its `Write`; a Vec never fails, so
// the results are ignored.
impl Writer<'_> {
    fn array(&mut self, n: usize) {
        let _ = rmp::encode::write_array_len(self.out, n as u32);
    }
    fn map(&mut self, n: usize) {
        let _ = rmp::encode::write_map_len(self.out, n as u32);
    }
    fn str(&mut self, s: &str) {
        let _ = rmp::encode::write_str(self.out, s);
    }
    fn nil(&mut self) {
        let _ = rmp::encode::write_nil(self.out);
    }
    fn uint(&mut self, v: u64) {
        let _ = rmp::encode::write_uint(self.out, v);
    }
    fn int(&mut self, v: i64) {
        let _ = rmp::encode::write_sint(self.out, v);
    }
    fn hash(&mut self, h: u64) {
        match self.form {
            HashForm::Uint => {
                let _ = rmp::encode::write_u64(self.out, h);
            }
            HashForm::Bin32 => {
                let mut digest = [0x5a; 32];
                digest[24..].copy_from_slice(&h.to_be_bytes());
                let _ = rmp::encode::write_bin(self.out, &digest);
            }
        }
    }
    fn hashes(&mut self, hs: &[u64]) {
        self.array(hs.len());
        for &h in hs {
            self.hash(h);
        }
    }
    fn opt_hash(&mut self, h: Option<u64>) {
        match h {
            Some(h) => self.hash(h),
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
        self.opt_str(m.map(Medium::name));
    }
    fn tokens(&mut self, t: &[u32]) {
        self.array(t.len());
        for &x in t {
            self.uint(u64::from(x));
        }
    }
    fn key(&mut self, k: &ExtraKey) {
        match k {
            ExtraKey::Nil => self.nil(),
            ExtraKey::Bool(b) => {
                let _ = rmp::encode::write_bool(self.out, *b);
            }
            ExtraKey::Int(v) => match (u64::try_from(*v), i64::try_from(*v)) {
                (Ok(u), _) => self.uint(u),
                (_, Ok(i)) => self.int(i),
                _ => self.nil(),
            },
            ExtraKey::Float(v) => {
                let _ = rmp::encode::write_f64(self.out, *v);
            }
            ExtraKey::Str(s) => self.str(s),
            ExtraKey::Bytes(b) => {
                let _ = rmp::encode::write_bin(self.out, b);
            }
            ExtraKey::List(items) => {
                self.array(items.len());
                for item in items {
                    self.key(item);
                }
            }
        }
    }
    fn extra_keys(&mut self, keys: Option<&Vec<Option<Vec<ExtraKey>>>>) {
        let Some(blocks) = keys else {
            return self.nil();
        };
        self.array(blocks.len());
        for block in blocks {
            match block {
                Some(keys) => {
                    self.array(keys.len());
                    for k in keys {
                        self.key(k);
                    }
                }
                None => self.nil(),
            }
        }
    }
}

/// Encodes a batch as vLLM's publisher would (every field written, `nil` when unset).
pub fn encode_batch(batch: &EventBatch, enc: Encoding, form: HashForm) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + batch.events.len() * 64);
    let mut w = Writer {
        out: &mut out,
        form,
    };
    w.array(if batch.data_parallel_rank.is_some() {
        3
    } else {
        2
    });
    let _ = rmp::encode::write_f64(w.out, batch.ts);
    w.array(batch.events.len());
    for ev in &batch.events {
        match (ev, enc) {
            (KvEvent::BlockStored(e), Encoding::Map) => {
                w.map(11);
                w.str("type");
                w.str("BlockStored");
                w.str("block_hashes");
                w.hashes(&e.block_hashes);
                w.str("parent_block_hash");
                w.opt_hash(e.parent_block_hash);
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
                w.str("extra_keys");
                w.extra_keys(e.extra_keys.as_ref());
                w.str("group_idx");
                w.opt_int(e.group_idx);
                w.str("kv_cache_spec_kind");
                w.opt_str(e.kv_cache_spec_kind.as_deref());
            }
            (KvEvent::BlockStored(e), Encoding::Array) => {
                w.array(11);
                w.str("BlockStored");
                w.hashes(&e.block_hashes);
                w.opt_hash(e.parent_block_hash);
                w.tokens(&e.token_ids);
                w.uint(u64::from(e.block_size));
                w.opt_int(e.lora_id);
                w.medium(e.medium.as_ref());
                w.opt_str(e.lora_name.as_deref());
                w.extra_keys(e.extra_keys.as_ref());
                w.opt_int(e.group_idx);
                w.opt_str(e.kv_cache_spec_kind.as_deref());
            }
            (KvEvent::BlockRemoved(e), Encoding::Map) => {
                w.map(4);
                w.str("type");
                w.str("BlockRemoved");
                w.str("block_hashes");
                w.hashes(&e.block_hashes);
                w.str("medium");
                w.medium(e.medium.as_ref());
                w.str("group_idx");
                w.opt_int(e.group_idx);
            }
            (KvEvent::BlockRemoved(e), Encoding::Array) => {
                w.array(4);
                w.str("BlockRemoved");
                w.hashes(&e.block_hashes);
                w.medium(e.medium.as_ref());
                w.opt_int(e.group_idx);
            }
            (KvEvent::AllBlocksCleared, Encoding::Map) => {
                w.map(1);
                w.str("type");
                w.str("AllBlocksCleared");
            }
            (KvEvent::AllBlocksCleared, Encoding::Array) => {
                w.array(1);
                w.str("AllBlocksCleared");
            }
            (KvEvent::Unknown { tag }, Encoding::Map) => {
                w.map(1);
                w.str("type");
                w.str(tag);
            }
            (KvEvent::Unknown { tag }, Encoding::Array) => {
                w.array(1);
                w.str(tag);
            }
        }
    }
    if let Some(r) = batch.data_parallel_rank {
        w.int(r);
    }
    out
}
