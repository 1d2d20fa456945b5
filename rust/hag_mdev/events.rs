// SPDX-License-Identifier: GPL-2.0-only
//! Events multicast on the `hag` generic netlink family's events group.
//!
//! An event is a notification: if it cannot be built or nobody listens, the
//! operation that caused it still succeeds, and a failure is logged once per
//! event so a lost event is visible in the kernel log.

use kernel::prelude::*;
use kernel::time::Ktime;

use crate::abi;
use crate::glue::EventMessage;
use crate::ratelimit::{AtomicLogBudget, LeftOut, Verdict};

/// Events not sent, for every vGPU: the log line's budget.
static NOT_SENT: AtomicLogBudget = AtomicLogBudget::new();

/// The longest message an event carries, bytes (a longer one is cut).
const MESSAGE_MAX: usize = 255;

/// An event about one vGPU, built then sent.
pub(crate) struct Event<'a> {
    kind: u32,
    vgpu_id: u32,
    uuid: &'a [u8; 16],
    message: Option<&'a str>,
}

impl<'a> Event<'a> {
    pub(crate) fn new(kind: u32, vgpu_id: u32, uuid: &'a [u8; 16]) -> Self {
        Self {
            kind,
            vgpu_id,
            uuid,
            message: None,
        }
    }

    /// Adds a human-readable detail.
    pub(crate) fn message(mut self, message: &'a str) -> Self {
        self.message = Some(message);
        self
    }

    /// Multicasts the event; logs (and otherwise ignores) a failure.
    pub(crate) fn send(self) {
        if let Err(e) = self.try_send() {
            // A slow listener fails every event: one line each would
            // flood the log at the guest's pace.
            let now = u64::try_from(Ktime::ktime_get().to_ns()).unwrap_or(0);
            if let Verdict::Print { suppressed } = NOT_SENT.check(now) {
                pr_warn!(
                    "event {} for vGPU {} not sent: error {}{}\n",
                    abi::event_name(self.kind),
                    self.vgpu_id,
                    e.to_errno(),
                    LeftOut(suppressed)
                );
            }
        }
    }

    fn try_send(&self) -> Result {
        let mut msg = EventMessage::new(abi::CMD_EVENT)?;
        msg.put_u32(abi::ATTR_EVENT, self.kind)?;
        msg.put_u32(abi::ATTR_VGPU_ID, self.vgpu_id)?;
        msg.put_bytes(abi::ATTR_VGPU_UUID, self.uuid)?;
        // ktime_get() is monotonic and never negative.
        let now = u64::try_from(Ktime::ktime_get().to_ns()).unwrap_or(0);
        msg.put_u64(abi::ATTR_TIMESTAMP_NS, now)?;
        if let Some(text) = self.message {
            // Netlink strings carry their NUL: the text and its NUL in a
            // buffer of their own (a hang's message, the longest, is about
            // 170 bytes: on the heap, not on the stack of a doorbell's deep
            // path), cut at a character's boundary.
            let mut len = text.len().min(MESSAGE_MAX);
            while !text.is_char_boundary(len) {
                len -= 1;
            }
            let mut buf = KVec::with_capacity(len + 1, GFP_KERNEL)?;
            buf.extend_from_slice(&text.as_bytes()[..len], GFP_KERNEL)?;
            buf.push(0, GFP_KERNEL)?;
            msg.put_bytes(abi::ATTR_MESSAGE, &buf)?;
        }
        msg.send()
    }
}
