//! What a response says about the routing decision that sent it: the
//! chosen pod served it, refused it, failed, or Envoy's retries had it
//! served by another pod. The filter acts on it (confirm or take back
//! learned blocks, pass over a failing pod); the logic lives here so it is
//! tested natively.
//!
//! A successful answer is judged twice: at its headers ([`judge`]) and when
//! the stream ends ([`judge_end`]), because a pod that dies mid-answer (a
//! restart) cuts streams whose headers said 200.

/// The response as the filter sees it at its headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Response<'a> {
    /// `:status`; `None` when Envoy did not give one.
    pub status: Option<u16>,
    /// `ip:port` of the upstream host that answered; `None` when no
    /// upstream answered (Envoy's own reply) or the host does not say.
    pub served_by: Option<&'a str>,
}

/// Whether a route's `%UPSTREAM_HOST%` header names a host: Envoy writes
/// `-` (or nothing) when no upstream host was picked.
pub fn names_a_host(value: &str) -> bool {
    !value.is_empty() && value != "-"
}

/// The verdict on one routing decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome<'a> {
    /// The chosen pod answered successfully: its blocks are confirmed.
    Confirmed,
    /// The chosen pod refused the request (4xx): it cached nothing for it.
    Refused,
    /// The chosen pod failed (5xx, or Envoy answered because no upstream
    /// did) and nothing else served the request.
    Failed,
    /// The chosen pod failed and Envoy's retry was served by `pod`; its
    /// blocks are cached there when `success` holds.
    ServedElsewhere { pod: &'a str, success: bool },
}

impl Outcome<'_> {
    /// The chosen pod failed this request.
    pub fn chosen_failed(&self) -> bool {
        matches!(self, Outcome::Failed | Outcome::ServedElsewhere { .. })
    }

    /// Every verdict's name, in [`Outcome::index`] order (stats, logs).
    pub const NAMES: [&'static str; 4] = ["confirmed", "refused", "failed", "rerouted"];

    pub fn index(&self) -> usize {
        match self {
            Outcome::Confirmed => 0,
            Outcome::Refused => 1,
            Outcome::Failed => 2,
            Outcome::ServedElsewhere { .. } => 3,
        }
    }

    pub fn name(&self) -> &'static str {
        Self::NAMES[self.index()]
    }
}

fn is_success(status: Option<u16>) -> bool {
    status.is_some_and(|s| (200..400).contains(&s))
}

/// Judges the response to a request routed to `chosen`.
pub fn judge<'a>(chosen: &str, response: &Response<'a>) -> Outcome<'a> {
    let success = is_success(response.status);
    match response.served_by {
        Some(pod) if pod != chosen => Outcome::ServedElsewhere { pod, success },
        _ if success => Outcome::Confirmed,
        served_by => match response.status {
            Some(s) if (400..500).contains(&s) && served_by.is_some() => Outcome::Refused,
            // 5xx, no status, or a 4xx that Envoy itself answered (no upstream).
            _ => Outcome::Failed,
        },
    }
}

/// Envoy's `response.code_details` prefix for an upstream that reset the
/// stream after its response had started (the pod died or dropped the
/// connection mid-answer).
const CUT_AFTER_START: &str = "upstream_reset_after_response_started";

/// The final verdict on a decision judged [`Outcome::Confirmed`] at its
/// headers, from Envoy's `response.code_details` when the stream ended: an
/// answer the chosen pod cut after it started is a failure of that pod (its
/// cache may be gone with it), not a confirmation. Other verdicts stand.
pub fn judge_end<'a>(at_headers: Outcome<'a>, code_details: Option<&str>) -> Outcome<'a> {
    match at_headers {
        Outcome::Confirmed if code_details.is_some_and(|d| d.starts_with(CUT_AFTER_START)) => {
            Outcome::Failed
        }
        verdict => verdict,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn judged(status: Option<u16>, served_by: Option<&str>) -> Outcome<'_> {
        judge("a:1", &Response { status, served_by })
    }

    #[test]
    fn a_route_header_without_an_upstream_host_names_no_pod() {
        assert!(names_a_host("10.0.0.7:8000"));
        assert!(!names_a_host("-"));
        assert!(!names_a_host(""));
    }

    #[test]
    fn verdicts() {
        assert_eq!(judged(Some(200), Some("a:1")), Outcome::Confirmed);
        assert_eq!(judged(Some(200), None), Outcome::Confirmed);
        assert_eq!(judged(Some(404), Some("a:1")), Outcome::Refused);
        assert_eq!(judged(Some(429), Some("a:1")), Outcome::Refused);
        assert_eq!(judged(Some(500), Some("a:1")), Outcome::Failed);
        assert_eq!(judged(Some(503), None), Outcome::Failed);
        assert_eq!(judged(Some(408), None), Outcome::Failed);
        assert_eq!(judged(None, None), Outcome::Failed);
        assert_eq!(
            judged(Some(200), Some("b:1")),
            Outcome::ServedElsewhere {
                pod: "b:1",
                success: true
            }
        );
        assert_eq!(
            judged(Some(500), Some("b:1")),
            Outcome::ServedElsewhere {
                pod: "b:1",
                success: false
            }
        );
    }

    #[test]
    fn only_failures_blame_the_chosen_pod() {
        assert!(!judged(Some(200), Some("a:1")).chosen_failed());
        assert!(!judged(Some(404), Some("a:1")).chosen_failed());
        assert!(judged(Some(502), Some("a:1")).chosen_failed());
        assert!(judged(Some(200), Some("b:1")).chosen_failed());
    }

    #[test]
    fn an_answer_cut_after_it_started_fails_the_pod_that_was_confirmed() {
        let confirmed = judged(Some(200), Some("a:1"));
        for cut in [
            "upstream_reset_after_response_started{remote_reset}",
            "upstream_reset_after_response_started{connection_termination}",
        ] {
            assert_eq!(judge_end(confirmed, Some(cut)), Outcome::Failed, "{cut}");
        }
        // Completed, or ended by the client: the confirmation stands.
        for ended in [
            None,
            Some("via_upstream"),
            Some("downstream_remote_disconnect"),
        ] {
            assert_eq!(judge_end(confirmed, ended), Outcome::Confirmed, "{ended:?}");
        }
        // A verdict already reached at the headers is not changed.
        let cut = Some("upstream_reset_after_response_started{remote_reset}");
        for verdict in [
            judged(Some(404), Some("a:1")),
            judged(Some(503), None),
            judged(Some(200), Some("b:1")),
        ] {
            assert_eq!(judge_end(verdict, cut), verdict);
        }
    }
}
