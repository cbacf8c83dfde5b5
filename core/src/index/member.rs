//! Who holds a block: a pod's handle, one member of a block's pod set, and
//! the generations and learned-age clock that say whether a member still
//! counts.

use crate::feed::Tier;

/// A pod's handle in the index, stable while the pod is in the pod set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PodId(pub(super) u32);

impl PodId {
    /// A pod id of a cluster that holds no index (never looked up in one).
    pub fn local(n: u32) -> PodId {
        PodId(n)
    }

    /// The id's position in dense per-pod tables.
    pub fn slot(self) -> usize {
        self.0 as usize
    }
}

/// Learned ages are kept in epochs of a sixteenth of the TTL.
pub(super) const EPOCHS_PER_TTL: u32 = 16;

const POD_BITS: u32 = 20;
/// Pods the index can tell apart at once.
pub const MAX_PODS: usize = 1 << POD_BITS;
const GEN_BITS: u32 = 26;
const GEN_MASK: u32 = (1 << GEN_BITS) - 1;

/// One pod in a block's set: pod (top bits, so sets sort by pod), the pod's
/// generation when written, tier, and the epoch a learned entry was taught.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Member(u64);

impl Member {
    pub(super) fn new(pod: PodId, generation: u32, tier: Tier, epoch: u16) -> Member {
        Member(
            (u64::from(pod.0) << (64 - POD_BITS))
                | (u64::from(generation & GEN_MASK) << 18)
                | (u64::from(tier.code()) << 16)
                | u64::from(epoch),
        )
    }

    /// The member as published (and hashed when interned).
    pub(super) fn bits(self) -> u64 {
        self.0
    }

    /// A member read back from its published bits.
    pub(super) fn from_bits(bits: u64) -> Member {
        Member(bits)
    }

    pub(super) fn pod(self) -> PodId {
        PodId((self.0 >> (64 - POD_BITS)) as u32)
    }

    pub(super) fn generation(self) -> u32 {
        (self.0 >> 18) as u32 & GEN_MASK
    }

    pub(super) fn tier(self) -> Tier {
        Tier::from_code((self.0 >> 16) as u8 & 3).unwrap_or(Tier::Learned)
    }

    pub(super) fn epoch(self) -> u16 {
        self.0 as u16
    }
}

/// Precise tiers are facts reported by the pod; only `Learned` ages by TTL.
pub(super) fn is_precise(tier: Tier) -> bool {
    tier != Tier::Learned
}

/// A pod's generations: a member counts only while it carries its pod's
/// current generation for its kind (learned or precise).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PodState {
    pub(super) learned_generation: u32,
    pub(super) precise_generation: u32,
}

impl PodState {
    /// Retires every member of the pod written so far.
    pub(super) fn clear(&mut self) {
        self.clear_learned();
        self.precise_generation = self.precise_generation.wrapping_add(1) & GEN_MASK;
    }

    /// Retires the pod's learned members; its own reports stay.
    pub(super) fn clear_learned(&mut self) {
        self.learned_generation = self.learned_generation.wrapping_add(1) & GEN_MASK;
    }
}

/// How a reader turns seconds into learned ages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Clock {
    pub(super) epoch_seconds: u32,
    pub(super) ttl_epochs: u16,
}

/// The second the learned epoch holding `now_s` began, for entries that
/// live `ttl_seconds` (see the module documentation).
pub fn epoch_start_s(ttl_seconds: u32, now_s: u32) -> u32 {
    let epoch_seconds = ttl_seconds.div_ceil(EPOCHS_PER_TTL).max(1);
    now_s - now_s % epoch_seconds
}

impl Clock {
    pub(super) fn epoch(self, now_s: u32) -> u16 {
        (now_s / self.epoch_seconds.max(1)) as u16
    }

    /// True when `member` still says something about its pod (`state`): its
    /// generation is current and, if learned, it has not expired at `epoch`.
    pub(super) fn is_current(self, state: Option<PodState>, member: Member, epoch: u16) -> bool {
        let Some(state) = state else {
            return false;
        };
        let tier = member.tier();
        member.generation() == generation_of(&state, tier)
            && (is_precise(tier) || epoch.wrapping_sub(member.epoch()) <= self.ttl_epochs)
    }
}

/// The generation a member of `tier` must carry to count for `pod`.
pub(super) fn generation_of(state: &PodState, tier: Tier) -> u32 {
    if is_precise(tier) {
        state.precise_generation
    } else {
        state.learned_generation
    }
}
