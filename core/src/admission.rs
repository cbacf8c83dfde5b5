//! Admission at saturation (issue 15): when every candidate pod is
//! saturated, a request of a sheddable class is answered 429 by the proxy
//! instead of joining a queue that only grows; critical requests always
//! route. With no `priority` configured nothing here runs.
//!
//! A pod is saturated when one of its configured tests holds (0 turns a
//! test off):
//! - with fresh pod reports (precise mode): `waiting ≥ max_waiting`, or
//!   `kv_usage ≥ max_kv_usage`, or running sequences ≥ `max_running` × the
//!   pod's speed;
//! - without (approximate mode): requests in flight ≥ `max_inflight_requests`
//!   × the pod's speed, or the proxy's active-block estimate ≥
//!   `max_kv_usage` × capacity.

use crate::config::{Admission, Saturation};
use crate::score::PodSignals;

/// Which test found a pod saturated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Saturated {
    Waiting,
    KvUsage,
    InFlight,
    Running,
}

impl Saturated {
    pub fn name(self) -> &'static str {
        match self {
            Saturated::Waiting => "waiting",
            Saturated::KvUsage => "kv_usage",
            Saturated::InFlight => "inflight",
            Saturated::Running => "running",
        }
    }
}

/// The first test that finds `pod` saturated, if any.
pub fn saturated(pod: &PodSignals, test: &Saturation) -> Option<Saturated> {
    let kv_limit = test.max_kv_usage > 0.0;
    let speed = if pod.speed.is_finite() && pod.speed > 0.0 {
        pod.speed
    } else {
        1.0
    };
    if pod.reported {
        if test.max_waiting > 0 && pod.waiting >= test.max_waiting {
            return Some(Saturated::Waiting);
        }
        // Compared in the pod's own precision: 0.9 reported is 0.9 configured.
        if kv_limit && pod.kv_usage >= test.max_kv_usage as f32 {
            return Some(Saturated::KvUsage);
        }
        let running_limit = f64::from(test.max_running) * speed;
        if test.max_running > 0 && f64::from(pod.running) >= running_limit {
            return Some(Saturated::Running);
        }
        return None;
    }
    let inflight_limit = f64::from(test.max_inflight_requests) * speed;
    if test.max_inflight_requests > 0 && f64::from(pod.inflight_requests) >= inflight_limit {
        return Some(Saturated::InFlight);
    }
    let kv_blocks = test.max_kv_usage * f64::from(pod.capacity_blocks);
    if kv_limit && pod.active_blocks as f64 >= kv_blocks {
        return Some(Saturated::KvUsage);
    }
    None
}

/// Why every candidate is saturated: the test that held on each, counted
/// (waiting, kv_usage, inflight, running). `None` when some candidate has
/// room (or there is none).
pub fn all_saturated(pods: &[PodSignals], test: &Saturation) -> Option<[usize; 4]> {
    if pods.is_empty() {
        return None;
    }
    let mut by_test = [0usize; 4];
    for pod in pods {
        let i = match saturated(pod, test)? {
            Saturated::Waiting => 0,
            Saturated::KvUsage => 1,
            Saturated::InFlight => 2,
            Saturated::Running => 3,
        };
        by_test[i] += 1;
    }
    Some(by_test)
}

/// True when a request of `admission` is shed: sheddable while every
/// candidate is saturated (`saturation` from [`all_saturated`]).
pub fn sheds(admission: Admission, saturation: Option<[usize; 4]>) -> bool {
    admission == Admission::Sheddable && saturation.is_some()
}

/// The decision header's account of a saturation: `saturated=N/N (waiting=…
/// kv_usage=… inflight=… running=…)`, the tests that held.
pub fn explain(by_test: [usize; 4]) -> String {
    let total: usize = by_test.iter().sum();
    let names = [
        Saturated::Waiting,
        Saturated::KvUsage,
        Saturated::InFlight,
        Saturated::Running,
    ];
    let held: Vec<String> = names
        .iter()
        .zip(by_test)
        .filter(|(_, n)| *n > 0)
        .map(|(t, n)| format!("{}={n}", t.name()))
        .collect();
    format!("saturated={total}/{total} ({})", held.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn test() -> Saturation {
        Saturation {
            max_waiting: 4,
            max_kv_usage: 0.9,
            max_inflight_requests: 10,
            max_running: 20,
        }
    }

    fn reported(waiting: u32, kv_usage: f32) -> PodSignals {
        PodSignals {
            reported: true,
            waiting,
            kv_usage,
            capacity_blocks: 100,
            speed: 1.0,
            // The proxy's own counts do not matter while the pod reports.
            inflight_requests: 1000,
            active_blocks: 1000,
            ..Default::default()
        }
    }

    fn estimated(inflight_requests: u32, active_blocks: u64, speed: f64) -> PodSignals {
        PodSignals {
            inflight_requests,
            active_blocks,
            capacity_blocks: 100,
            speed,
            ..Default::default()
        }
    }

    #[test]
    fn pod_reports_decide_while_fresh() {
        let t = test();
        assert_eq!(saturated(&reported(3, 0.5), &t), None);
        assert_eq!(saturated(&reported(4, 0.5), &t), Some(Saturated::Waiting));
        assert_eq!(saturated(&reported(0, 0.9), &t), Some(Saturated::KvUsage));
        // A pod absorbing overload as a larger batch, not a queue; a half-speed
        // pod is full at half the sequences.
        let running = |n: u32, speed: f64| PodSignals {
            running: n,
            speed,
            ..reported(0, 0.5)
        };
        assert_eq!(saturated(&running(19, 1.0), &t), None);
        assert_eq!(saturated(&running(20, 1.0), &t), Some(Saturated::Running));
        assert_eq!(saturated(&running(10, 0.5), &t), Some(Saturated::Running));
        let off = Saturation {
            max_waiting: 0,
            max_kv_usage: 0.0,
            max_running: 0,
            ..t
        };
        assert_eq!(saturated(&reported(1000, 1.0), &off), None);
        assert_eq!(saturated(&running(1000, 1.0), &off), None);
    }

    #[test]
    fn the_proxys_estimate_decides_without_reports_scaled_by_speed() {
        let t = test();
        assert_eq!(saturated(&estimated(9, 0, 1.0), &t), None);
        assert_eq!(
            saturated(&estimated(10, 0, 1.0), &t),
            Some(Saturated::InFlight)
        );
        // A half-speed pod is full at half the requests.
        assert_eq!(
            saturated(&estimated(5, 0, 0.5), &t),
            Some(Saturated::InFlight)
        );
        assert_eq!(saturated(&estimated(4, 89, 0.5), &t), None);
        assert_eq!(
            saturated(&estimated(0, 90, 1.0), &t),
            Some(Saturated::KvUsage)
        );
    }

    #[test]
    fn only_sheddable_requests_are_shed_and_only_when_every_pod_is_saturated() {
        let t = test();
        let full = [reported(5, 0.1), estimated(10, 0, 1.0), reported(0, 0.95)];
        let by_test = all_saturated(&full, &t);
        assert_eq!(by_test, Some([1, 1, 1, 0]));
        assert!(sheds(Admission::Sheddable, by_test));
        assert!(!sheds(Admission::Critical, by_test));
        let one_free = [reported(5, 0.1), reported(3, 0.1)];
        assert_eq!(all_saturated(&one_free, &t), None);
        assert!(!sheds(Admission::Sheddable, all_saturated(&one_free, &t)));
        assert_eq!(all_saturated(&[], &t), None);
        assert_eq!(
            explain([2, 0, 1, 1]),
            "saturated=4/4 (waiting=2 inflight=1 running=1)"
        );
    }
}
