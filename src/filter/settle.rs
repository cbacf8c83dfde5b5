//! A routed request's outcome: the response judged against the decision
//! (what the pod is taught, or whether it failed), its prefill done, and its
//! load released when the stream ends.

use super::RequestFilter;
use crate::host;
use crate::remote;
use kvroute_core::outcome::{judge, judge_end, Outcome, Response};

impl RequestFilter {
    /// Judges the response against the decision and acts on the verdict; a
    /// successful answer waits for its end ([`RequestFilter::settle_end`]).
    pub(super) fn settle(&mut self, status: Option<u16>, served_by: Option<&str>) {
        let Some(request) = self.unsettled.take() else {
            return;
        };
        let outcome = judge(&request.pod, &Response { status, served_by });
        if outcome == Outcome::Confirmed {
            self.answering = Some(request);
        } else if let Ok(mut w) = self.worker.try_borrow_mut() {
            w.settle(&request, outcome, &self.request_id);
        }
    }

    /// The stream ended: a successful answer is confirmed, or fails its pod
    /// when the pod cut it (it died mid-answer, e.g. restarted; the blocks
    /// learned about it go and it is passed over, as for any failure).
    pub(super) fn settle_end(&mut self) {
        let Some(request) = self.answering.take() else {
            return;
        };
        // Only a response that did not pass whole can have been cut: the
        // property read is spared for the others.
        let details = if self.response_complete {
            None
        } else {
            host::property(&["response", "code_details"])
        };
        let outcome = judge_end(Outcome::Confirmed, details.as_deref());
        if let Ok(mut w) = self.worker.try_borrow_mut() {
            w.settle(&request, outcome, &self.request_id);
        }
    }

    /// The first response bytes mean the pod finished this prompt's prefill:
    /// its blocks stop counting as that pod's pending work.
    pub(super) fn prefill_done(&mut self) {
        let Some((pod, prompt_blocks, _)) = self.in_flight.as_mut() else {
            return;
        };
        if *prompt_blocks == 0 {
            return;
        }
        let blocks = std::mem::take(prompt_blocks);
        if self.looked_up {
            remote::prefill_done(pod, blocks);
        } else if let Ok(mut w) = self.worker.try_borrow_mut() {
            w.prefill_done(pod, blocks);
        }
    }

    pub(super) fn release(&mut self) {
        if let Some((pod, prompt_blocks, routed_blocks)) = self.in_flight.take() {
            if self.looked_up {
                remote::finished(&pod, prompt_blocks);
            } else if let Ok(mut w) = self.worker.try_borrow_mut() {
                w.finished(&pod, prompt_blocks, routed_blocks);
            }
        }
    }
}
