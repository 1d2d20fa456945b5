//! The GPU command auditor of hag.
//!
//! A mediated vGPU's guest submits Intel GEN command buffers: a slice of its
//! ring buffer, which may start batch buffers in graphics memory. Before any
//! of it runs, [`audit::audit`] decodes every command (Gen8/Gen9 encodings
//! from Intel's public programmer's reference manuals), validates it, and
//! derives its **write set**: the graphics memory it may write, each range
//! tagged with its [`AddressSpace`](audit::AddressSpace) (the global GTT or
//! the workload's PPGTT). The kernel translates write sets to guest pages and
//! turns them into dirty bits, so a VM with a vGPU can be migrated and
//! checkpointed incrementally.
//!
//! # Promises
//!
//! - **Never misses a write.** A command's [`Command::write_set`](audit::Command::write_set) covers
//!   every byte the hardware may write for it (store, atomic and copy
//!   destinations, post-sync writes of `MI_FLUSH_DW` and `PIPE_CONTROL`,
//!   blit rectangles row by row), in the address space the hardware uses
//!   for it: everything in a PPGTT batch (and the batches it chains to or
//!   starts) is PPGTT whatever a command's GGTT bit says; in the ring and
//!   GGTT batches the GGTT bit selects; the status page is GGTT. Where
//!   modelling a feature exactly is not worth the risk (tiled blits,
//!   predicated batch starts, a batch start that changes address space,
//!   `MI_ATOMIC` return data, any PPGTT address when
//!   [`AuditConfig::ppgtt_size`](audit::AuditConfig::ppgtt_size) is 0…), the
//!   command is refused, by name.
//! - **Everything inside the vGPU's memory.** Every address a validated
//!   command uses, read or written, lies with its whole extent in
//!   `[0, gfx_mem_size)` (GGTT) or `[0, ppgtt_size)` (PPGTT); all arithmetic
//!   on guest values is checked.
//! - **Never panics, bounded work, no recursion.** Any dword stream is
//!   either accepted or rejected with an [`AuditError`](audit::AuditError) that names the
//!   command, its address and the offending values. Work is bounded by
//!   [`AuditConfig::max_commands`](audit::AuditConfig::max_commands), [`AuditConfig::max_batches`](audit::AuditConfig::max_batches) and
//!   [`AuditConfig::max_batch_depth`](audit::AuditConfig::max_batch_depth); nesting uses a fixed-size stack.
//!   What a sink must keep is bounded by [`AuditConfig::max_entries`](audit::AuditConfig::max_entries),
//!   counted in validated commands (a register load of n pairs is n), the
//!   unit that costs memory.
//! - **Validate once.** The sink receives [`ValidatedCommand`](audit::ValidatedCommand)s in execution
//!   order; an executor runs exactly those, never guest memory re-read. A
//!   rejected submission is rejected whole: discard what the sink got.
//!
//! `no_std`, `core` only, no `alloc`, no `unsafe`: the kernel module includes
//! [`audit`] as a module of its own (`#[path]`).
//!
//! # Main types
//!
//! - [`audit::audit`]: the entry point.
//! - [`AuditConfig`](audit::AuditConfig): graphics memory (GGTT) and PPGTT sizes, status page,
//!   limits, register allow list.
//! - [`GfxMemory`](audit::GfxMemory): how batch buffers are read, in either address space;
//!   [`AuditSink`](audit::AuditSink): where validated commands go.
//! - [`Command`](audit::Command) and its [`WriteSet`](audit::WriteSet) ([`WriteRange`](audit::WriteRange) or [`Strided`](audit::Strided) rows,
//!   each in one [`AddressSpace`](audit::AddressSpace)), [`pages_of`](audit::pages_of) and
//!   [`WriteSet::pages`](audit::WriteSet::pages) for 4 KiB dirty pages of that space.
//! - [`AuditError`](audit::AuditError) with its [`Reason`](audit::Reason).
//! - [`audit::encode`]: builds each command's dwords.
//!
//! # Example
//!
//! ```
//! use hag_audit::audit::{audit, encode, AddressSpace, AuditConfig, AuditSink, Command,
//!                        SinkFull, SliceMemory, ValidatedCommand, WriteRange, WriteSet};
//!
//! /// Collects the pages written (a kernel would translate them through the
//! /// GGTT or the PPGTT and set dirty bits).
//! struct Dirty([(AddressSpace, u64); 8], usize);
//! impl AuditSink for Dirty {
//!     fn command(&mut self, cmd: &ValidatedCommand) -> Result<(), SinkFull> {
//!         for range in cmd.kind.write_set().ranges() {
//!             for page in range.pages() {
//!                 *self.0.get_mut(self.1).ok_or(SinkFull)? = (range.space, page);
//!                 self.1 += 1;
//!             }
//!         }
//!         Ok(())
//!     }
//! }
//!
//! // A batch buffer at 0x10000 that stores a dword at 0x2_0004 and ends.
//! let mut batch = [0u32; 8];
//! batch[..4].copy_from_slice(&encode::store_data_imm(0x2_0004, 7));
//! batch[4] = encode::batch_buffer_end()[0];
//! let mut mem = SliceMemory { space: AddressSpace::Ggtt, base: 0x10000, dwords: &batch };
//!
//! // The ring starts it.
//! let ring = encode::batch_buffer_start(0x10000, false);
//! let cfg = AuditConfig::new(16 << 20, 0);
//! let mut dirty = Dirty([(AddressSpace::Ggtt, 0); 8], 0);
//! let summary = audit(&ring, 0x1000, &cfg, &mut mem, &mut dirty).unwrap();
//! assert_eq!(summary.batches, 1);
//! assert_eq!(&dirty.0[..dirty.1], &[(AddressSpace::Ggtt, 0x20)]);
//!
//! // The same batch in a workload's PPGTT: the hardware runs it
//! // non-privileged, so its store is a PPGTT write despite its GGTT bit.
//! let ppgtt = AuditConfig::new(16 << 20, 0).with_ppgtt(1 << 32);
//! let mut user = SliceMemory { space: AddressSpace::Ppgtt, ..mem };
//! let ring = encode::batch_buffer_start_ppgtt(0x10000, false);
//! let mut dirty = Dirty([(AddressSpace::Ggtt, 0); 8], 0);
//! audit(&ring, 0x1000, &ppgtt, &mut user, &mut dirty).unwrap();
//! assert_eq!(&dirty.0[..dirty.1], &[(AddressSpace::Ppgtt, 0x20)]);
//! // Without a PPGTT in the configuration it is refused.
//! let err = audit(&ring, 0x1000, &cfg, &mut user, &mut dirty).unwrap_err();
//! assert_eq!(err.to_string(),
//!     "MI_BATCH_BUFFER_START at 0x1000: unsupported: batch buffer in the PPGTT address space");
//!
//! // A store past the end of graphics memory is refused, with the numbers.
//! let bad = encode::store_data_imm(16 << 20, 7);
//! let err = audit(&bad[..3], 0x1000, &cfg, &mut mem, &mut dirty).unwrap_err();
//! assert_eq!(err.to_string(),
//!     "MI_STORE_DATA_IMM at 0x1000: command needs 4 dwords but only 3 are left in the ring");
//! let err = audit(&bad, 0x1000, &cfg, &mut mem, &mut dirty).unwrap_err();
//! assert_eq!(err.to_string(),
//!     "MI_STORE_DATA_IMM at 0x1000: address 0x1000000+4 outside graphics memory of 0x1000000 bytes");
//! // In the PPGTT the limit is the PPGTT's size, and the error says so.
//! let bad = encode::ppgtt(encode::store_data_imm(1 << 32, 7));
//! let err = audit(&bad, 0x1000, &ppgtt, &mut mem, &mut dirty).unwrap_err();
//! assert_eq!(err.to_string(),
//!     "MI_STORE_DATA_IMM at 0x1000: PPGTT address 0x100000000+4 outside the PPGTT of 0x100000000 bytes");
//! # let _ = (Command::Noop, WriteSet::None,
//! #          WriteRange { space: AddressSpace::Ggtt, gfx_addr: 0, len: 0 });
//! ```
#![no_std]

pub mod audit;
