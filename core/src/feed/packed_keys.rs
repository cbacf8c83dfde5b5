//! The feed's packed key lists: ascending index keys, Elias–Fano coded (the
//! format is stated in the feed module's documentation).

use super::FeedError;
use crate::codec::Reader;

/// Bits of an index key.
const KEY_BITS: u32 = crate::hash::INDEX_KEY_BITS;
/// Fewest low bits a packed key takes: at least a byte a key, so that a
/// decoder allocates at most 8 bytes per byte of input.
const MIN_LOW_BITS: u32 = 8;

/// Bits of `n` packed keys with `low` low bits each.
fn packed_bits(n: u64, low: u32) -> u64 {
    let high = KEY_BITS - low;
    let unary = if high == 0 {
        0
    } else {
        n.saturating_add((1u64 << high) - 1)
    };
    n.saturating_mul(u64::from(low)).saturating_add(unary)
}

/// Low bits per key of `n` packed keys: the fewest bytes, ties to more low bits.
fn packed_low_bits(n: u64) -> u32 {
    (MIN_LOW_BITS..=KEY_BITS)
        .rev()
        .min_by_key(|&low| packed_bits(n, low).div_ceil(8))
        .unwrap_or(KEY_BITS)
}

/// Bytes of `n` packed keys.
pub(super) fn packed_len(n: u64) -> u64 {
    packed_bits(n, packed_low_bits(n)).div_ceil(8)
}

/// Appends bits, least significant first.
struct BitWriter<'a> {
    out: &'a mut Vec<u8>,
    acc: u64,
    /// Bits in `acc` (fewer than 8 between calls).
    fill: u32,
}

impl BitWriter<'_> {
    /// The low `bits` (at most 48) bits of `v`.
    fn put(&mut self, v: u64, bits: u32) {
        if bits == 0 {
            return;
        }
        self.acc |= (v & ((1u64 << bits) - 1)) << self.fill;
        self.fill += bits;
        while self.fill >= 8 {
            self.out.push(self.acc as u8);
            self.acc >>= 8;
            self.fill -= 8;
        }
    }

    fn zeros(&mut self, mut n: u64) {
        while n > 0 {
            let bits = n.min(32);
            self.put(0, bits as u32);
            n -= bits;
        }
    }

    fn finish(self) {
        if self.fill > 0 {
            self.out.push(self.acc as u8);
        }
    }
}

/// Reads bits, least significant first, up to `limit`.
struct BitReader<'a> {
    bytes: &'a [u8],
    pos: u64,
    limit: u64,
}

impl BitReader<'_> {
    /// The next `bits` bits (at most 56) without moving on; bits past the
    /// input read as zeros. One unaligned word read instead of a loop per byte.
    fn peek(&self, bits: u32) -> u64 {
        let at = usize::try_from(self.pos / 8).unwrap_or(usize::MAX);
        let rest = self.bytes.get(at..).unwrap_or_default();
        let word = match rest.first_chunk::<8>() {
            Some(eight) => u64::from_le_bytes(*eight),
            None => rest
                .iter()
                .rev()
                .fold(0u64, |word, &byte| (word << 8) | u64::from(byte)),
        };
        (word >> (self.pos % 8)) & ((1u64 << bits) - 1)
    }

    /// `bits` bits (at most [`KEY_BITS`]); the caller checked they lie
    /// within `limit`.
    fn get(&mut self, bits: u32) -> u64 {
        let v = self.peek(bits);
        self.pos += u64::from(bits);
        v
    }

    /// The zeros before the next one bit, which is read too; `None` when
    /// `limit` comes first.
    fn unary(&mut self) -> Option<u64> {
        let mut zeros = 0u64;
        while self.pos < self.limit {
            let window = (self.limit - self.pos).min(56) as u32;
            let word = self.peek(window);
            if word != 0 {
                let skipped = word.trailing_zeros();
                self.pos += u64::from(skipped) + 1;
                return Some(zeros + u64::from(skipped));
            }
            zeros += u64::from(window);
            self.pos += u64::from(window);
        }
        None
    }
}

/// Packs ascending index keys (see the module's format).
pub(super) fn put_packed(out: &mut Vec<u8>, ascending: &[u64]) {
    let low = packed_low_bits(ascending.len() as u64);
    let mut w = BitWriter {
        out,
        acc: 0,
        fill: 0,
    };
    for &key in ascending {
        w.put(key, low);
    }
    if low < KEY_BITS {
        let mut high = 0;
        for &key in ascending {
            let h = key >> low;
            w.zeros(h - high);
            w.put(1, 1);
            high = h;
        }
        w.zeros((1u64 << (KEY_BITS - low)) - 1 - high);
    }
    w.finish();
}

/// Reads `n` packed keys, ascending.
pub(super) fn packed(r: &mut Reader<'_>, n: usize) -> Result<Vec<u64>, FeedError> {
    let low = packed_low_bits(n as u64);
    let bits = packed_bits(n as u64, low);
    let bytes = r.take(bits.div_ceil(8) as usize, "keys")?;
    let mut reader = BitReader {
        bytes,
        pos: 0,
        limit: bits,
    };
    let mut keys: Vec<u64> = (0..n).map(|_| reader.get(low)).collect();
    if low < KEY_BITS {
        let mut high = 0u64;
        for key in &mut keys {
            high += reader.unary().ok_or(FeedError::BadKeyList)?;
            *key |= high << low;
        }
    }
    // One encoding per list: its keys ascend.
    if keys.windows(2).any(|w| w[0] > w[1]) {
        return Err(FeedError::BadKeyList);
    }
    // The rest of the unary part and the padding are zeros.
    reader.limit = bytes.len() as u64 * 8;
    if reader.unary().is_some() {
        return Err(FeedError::BadKeyList);
    }
    Ok(keys)
}
