//! Candidate A end to end: a fleet's block → pod-set index held once per Envoy in shared-data
//! buckets (fixed keys `b/<i>`, 8-byte slots: 32-bit fingerprint, 32-bit pod-set reference),
//! interned pod sets under `p/<id>`, and the decision that bisects a prompt's chain with one
//! bucket read per probe.
//!
//! The fleet is synthetic: every bucket is filled to `fill` with random unshared entries (the
//! worst case for an inverted index), plus one 512-block prompt cached at three depths: all of
//! it on pod 3, the first 256 blocks on pods 10..60, the first 64 on pods 100..600. The reader
//! checks its answer against that before reporting a decision as valid.

use std::borrow::Cow;
use std::collections::HashMap;

pub const HOT_BLOCKS: usize = 512;
/// A pod-set reference with this bit is an interned set (`p/<id>`); without, a single pod.
pub const INTERNED: u32 = 1 << 31;

pub fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

pub fn hot_chain() -> Vec<u64> {
    let mut rng = 7u64;
    (0..HOT_BLOCKS).map(|_| splitmix(&mut rng)).collect()
}

/// The interned sets of the hot prompt: set 0 holds blocks 0..64, set 1 blocks 64..256.
pub fn hot_sets() -> [Vec<u16>; 2] {
    let deep: Vec<u16> = std::iter::once(3).chain(10..60).collect();
    let mut shallow: Vec<u16> = deep.iter().copied().chain(100..600).collect();
    shallow.sort_unstable();
    [shallow, deep]
}

fn hot_value(block: usize) -> u32 {
    match block {
        0..64 => INTERNED,
        64..256 => INTERNED | 1,
        _ => 3,
    }
}

/// The expected answer: (pod, blocks matched), sorted by pod.
pub fn expected() -> Vec<(u16, usize)> {
    let mut all: Vec<(u16, usize)> = std::iter::once((3, 512))
        .chain((10..60).map(|p| (p, 256)))
        .chain((100..600).map(|p| (p, 64)))
        .collect();
    all.sort_unstable();
    all
}

#[derive(Clone, Copy)]
pub struct Layout {
    pub buckets: u64,
    pub slots: usize,
}

impl Layout {
    pub fn new(buckets: u64, bucket_bytes: usize) -> Layout {
        Layout {
            buckets: buckets.max(1),
            slots: (bucket_bytes / 8).max(1),
        }
    }

    /// From the block hash's high bits; the fingerprint is its low 32.
    pub fn bucket_of(&self, block: u64) -> u64 {
        ((u128::from(block) * u128::from(self.buckets)) >> 64) as u64
    }

    fn fingerprint(block: u64) -> u64 {
        u64::from(block as u32 | 1)
    }

    fn slot(bucket: &[u8], i: usize) -> u64 {
        let mut word = [0u8; 8];
        word.copy_from_slice(&bucket[i * 8..i * 8 + 8]);
        u64::from_le_bytes(word)
    }

    /// Linear probing inside the bucket; false when it is full.
    pub fn insert(&self, bucket: &mut [u8], block: u64, set: u32) -> bool {
        let fp = Self::fingerprint(block);
        let mut i = fp as usize % self.slots;
        for _ in 0..self.slots {
            let entry = Self::slot(bucket, i);
            if entry == 0 || entry >> 32 == fp {
                bucket[i * 8..i * 8 + 8]
                    .copy_from_slice(&((fp << 32) | u64::from(set)).to_le_bytes());
                return true;
            }
            i = (i + 1) % self.slots;
        }
        false
    }

    pub fn find(&self, bucket: &[u8], block: u64) -> Option<u32> {
        if bucket.len() < self.slots * 8 {
            return None;
        }
        let fp = Self::fingerprint(block);
        let mut i = fp as usize % self.slots;
        for _ in 0..self.slots {
            let entry = Self::slot(bucket, i);
            if entry == 0 {
                return None;
            }
            if entry >> 32 == fp {
                return Some(entry as u32);
            }
            i = (i + 1) % self.slots;
        }
        None
    }
}

pub fn bucket_key(bucket: u64) -> String {
    format!("b/{bucket}")
}

pub fn set_key(id: u32) -> String {
    format!("p/{id}")
}

/// Writes the fleet, a few buckets per call, on the singleton.
pub struct FleetWriter {
    layout: Layout,
    fill: f64,
    hot: HashMap<u64, Vec<(u64, u32)>>,
    rng: u64,
}

impl FleetWriter {
    pub fn new(layout: Layout, fill: f64) -> FleetWriter {
        let mut hot: HashMap<u64, Vec<(u64, u32)>> = HashMap::new();
        for (i, block) in hot_chain().into_iter().enumerate() {
            hot.entry(layout.bucket_of(block))
                .or_default()
                .push((block, hot_value(i)));
        }
        FleetWriter {
            layout,
            fill,
            hot,
            rng: 1,
        }
    }

    /// The interned sets, encoded (pods as little-endian u16).
    pub fn sets(&self) -> Vec<(String, Vec<u8>)> {
        hot_sets()
            .iter()
            .enumerate()
            .map(|(id, pods)| {
                (
                    set_key(id as u32),
                    pods.iter().flat_map(|p| p.to_le_bytes()).collect(),
                )
            })
            .collect()
    }

    /// Bucket `b`: the hot prompt's entries that fall in it, then random single-pod entries
    /// up to the fill.
    pub fn bucket(&mut self, b: u64) -> Vec<u8> {
        let mut bucket = vec![0u8; self.layout.slots * 8];
        let mut held = 0;
        for &(block, set) in self.hot.get(&b).map_or(&[][..], |v| v.as_slice()) {
            if self.layout.insert(&mut bucket, block, set) {
                held += 1;
            }
        }
        let target = (self.layout.slots as f64 * self.fill) as usize;
        // Random blocks whose high bits put them in this bucket (the fingerprint is the rest).
        let first = ((u128::from(b) << 64).div_ceil(u128::from(self.layout.buckets)) as u64)
            .next_multiple_of(1 << 32);
        while held < target {
            let block = first | (splitmix(&mut self.rng) & 0xffff_ffff);
            let pod = (splitmix(&mut self.rng) % 1000) as u32;
            if self.layout.bucket_of(block) == b && self.layout.insert(&mut bucket, block, pod) {
                held += 1;
            }
        }
        bucket
    }
}

/// What `match_lengths` reads: a bucket or an interned pod set.
#[derive(Clone, Copy)]
pub enum Key {
    Bucket(u64),
    Set(u32),
}

impl Key {
    pub fn shared_data_name(self) -> String {
        match self {
            Key::Bucket(b) => bucket_key(b),
            Key::Set(id) => set_key(id),
        }
    }
}

/// Every pod's longest cached prefix of `chain` (pods with none left out), reading buckets
/// and sets through `read` (shared data for candidate A, the VM's own memory for B); returns
/// the answer and the bucket reads spent. Pod sets shrink along a chain, so bisecting between
/// two probes whose sets differ finds every point where pods drop out.
pub fn match_lengths<'a>(
    layout: &Layout,
    chain: &[u64],
    read: &mut dyn FnMut(Key) -> Option<Cow<'a, [u8]>>,
) -> (Vec<(u16, usize)>, usize) {
    let mut probes = 0;
    let mut probe = |i: usize, read: &mut dyn FnMut(Key) -> Option<Cow<'a, [u8]>>| {
        probes += 1;
        let bucket = read(Key::Bucket(layout.bucket_of(chain[i])))?;
        layout.find(&bucket, chain[i])
    };
    let mut out = Vec::new();
    let n = chain.len();
    if n == 0 {
        return (out, 0);
    }
    let first = probe(0, read);
    if first.is_none() {
        return (out, probes);
    }
    let last = probe(n - 1, read);
    let mut drops: Vec<(usize, u32)> = Vec::new();
    let mut stack = vec![(0usize, first, n - 1, last)];
    while let Some((lo, s_lo, hi, s_hi)) = stack.pop() {
        if s_lo == s_hi {
            continue;
        }
        if hi - lo == 1 {
            if let Some(s) = s_lo {
                drops.push((lo, s));
            }
            continue;
        }
        let mid = lo + (hi - lo) / 2;
        let s_mid = probe(mid, read);
        stack.push((lo, s_lo, mid, s_mid));
        stack.push((mid, s_mid, hi, s_hi));
    }
    if let Some(s) = last {
        drops.push((n - 1, s));
    }
    for (i, set) in drops {
        if set & INTERNED == 0 {
            out.push((set as u16, i + 1));
        } else if let Some(pods) = read(Key::Set(set & !INTERNED)) {
            out.extend(
                pods.chunks_exact(2)
                    .map(|p| (u16::from_le_bytes([p[0], p[1]]), i + 1)),
            );
        }
    }
    out.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
    out.dedup_by_key(|e| e.0);
    (out, probes)
}

/// Candidate B: the same buckets and sets held in this VM's own memory.
pub struct LocalFleet {
    pub layout: Layout,
    buckets: Vec<Vec<u8>>,
    sets: Vec<Vec<u8>>,
}

impl LocalFleet {
    pub fn build(layout: Layout, fill: f64) -> LocalFleet {
        let mut writer = FleetWriter::new(layout, fill);
        LocalFleet {
            layout,
            sets: writer.sets().into_iter().map(|(_, v)| v).collect(),
            buckets: (0..layout.buckets).map(|b| writer.bucket(b)).collect(),
        }
    }

    pub fn read(&self, key: Key) -> Option<Cow<'_, [u8]>> {
        let found = match key {
            Key::Bucket(b) => self.buckets.get(b as usize),
            Key::Set(id) => self.sets.get(id as usize),
        };
        found.map(|v| Cow::Borrowed(v.as_slice()))
    }
}
