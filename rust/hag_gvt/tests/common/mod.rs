//! Helpers of the hag_gvt tests.

pub mod i915;
