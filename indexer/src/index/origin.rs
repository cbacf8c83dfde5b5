//! How a pod became known: bits of a pod's `origins`, one per way (a pod
//! known several ways goes when the last of them drops it).

/// `--pod`.
pub const STATIC: u8 = 1;
/// DNS of the headless Service.
pub const DNS: u8 = 2;
/// First seen in an event (only with `--accept-unknown-publishers`).
pub const EVENTS: u8 = 4;
/// `--connect ENDPOINT=ADDRESS`.
pub const CONNECT: u8 = 8;
