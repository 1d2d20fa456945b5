//! The executor's walk ([`flow::Exec`]) over the auditor's list runs what
//! the hardware runs: for random valid streams of rings and batches that
//! call, chain, return, loop and start batches already audited, the
//! commands `Exec` runs are the hardware's, in its order, ending where the
//! hardware ends or running on (a hang for the watchdog) where it loops.

mod common;

use common::*;
use hag_audit::audit::flow::{Exec, FlowError};
use hag_audit::audit::{encode, Command, ValidatedCommand};
use proptest::prelude::*;

/// Where the test batches live: batch k at `BATCHES + k * BATCH_SPAN`.
const BATCHES: u64 = 0x10_0000;
const BATCH_SPAN: u64 = 0x1000;
/// Stores write here, one qword per store id, so each is distinct.
const DATA: u64 = 0x20_0000;
/// Steps compared: a walk that runs longer loops (the hardware would hang).
const STEPS: usize = 3000;

#[derive(Clone, Copy, Debug)]
enum Op {
    Store,
    /// A plain batch start: from the ring a batch, from a batch a chain.
    Start(usize),
    /// A second-level start (batches only).
    Call(usize),
    End,
}

/// A submission: ring ops and each batch's ops, with every op's address.
#[derive(Debug)]
struct Program {
    ring: Vec<(u64, Op)>,
    batches: Vec<Vec<(u64, Op)>>,
}

fn encode_op(op: Op, id: u64) -> Vec<u32> {
    match op {
        Op::Store => encode::store_data_imm(DATA + id * 8, id as u32).to_vec(),
        Op::Start(k) => encode::batch_buffer_start(BATCHES + k as u64 * BATCH_SPAN, false).to_vec(),
        Op::Call(k) => encode::batch_buffer_start(BATCHES + k as u64 * BATCH_SPAN, true).to_vec(),
        Op::End => encode::batch_buffer_end().to_vec(),
    }
}

/// Lays the program out: the ring's dwords, and memory with every batch.
fn build(ring_ops: &[Op], batch_ops: &[Vec<Op>]) -> (Program, Vec<u32>, Mem) {
    let mut id = 0;
    let mut lay = |base: u64, ops: &[Op], out: &mut Vec<u32>| {
        ops.iter()
            .map(|&op| {
                let at = base + 4 * out.len() as u64;
                out.extend(encode_op(op, id));
                id += 1;
                (at, op)
            })
            .collect::<Vec<_>>()
    };
    let mut ring = Vec::new();
    let ring_laid = lay(RING, ring_ops, &mut ring);
    let mut mem = Mem::new();
    let mut batches = Vec::new();
    for (k, ops) in batch_ops.iter().enumerate() {
        let base = BATCHES + k as u64 * BATCH_SPAN;
        let mut dw = Vec::new();
        batches.push(lay(base, ops, &mut dw));
        mem.put(base, &dw);
    }
    (
        Program {
            ring: ring_laid,
            batches,
        },
        ring,
        mem,
    )
}

/// What the hardware runs: the address of every command, in order, at
/// most `STEPS`; `true` if it reached the ring's end.
fn hardware(p: &Program) -> (Vec<u64>, bool) {
    #[derive(Clone, Copy)]
    enum At {
        Ring(usize),
        Batch(usize, usize),
    }
    let mut at = At::Ring(0);
    let mut level = 0usize;
    let mut ring_return = 0;
    let mut ret = [(0usize, 0usize); 16];
    let mut trace = Vec::new();
    while trace.len() < STEPS {
        match at {
            At::Ring(i) => {
                let Some(&(addr, op)) = p.ring.get(i) else {
                    return (trace, true);
                };
                trace.push(addr);
                at = match op {
                    Op::Start(k) => {
                        level = 1;
                        ring_return = i + 1;
                        At::Batch(k, 0)
                    }
                    _ => At::Ring(i + 1),
                };
            }
            At::Batch(k, i) => {
                let (addr, op) = p.batches[k][i];
                trace.push(addr);
                at = match op {
                    Op::Store => At::Batch(k, i + 1),
                    Op::Start(j) => At::Batch(j, 0),
                    Op::Call(j) => {
                        level += 1;
                        ret[level] = (k, i + 1);
                        At::Batch(j, 0)
                    }
                    Op::End => {
                        level -= 1;
                        if level == 0 {
                            At::Ring(ring_return)
                        } else {
                            let (k, i) = ret[level + 1];
                            At::Batch(k, i)
                        }
                    }
                };
            }
        }
    }
    (trace, false)
}

/// What `Exec` runs over the validated list, as `hardware` reports it.
fn executed(cmds: &[ValidatedCommand]) -> Result<(Vec<u64>, bool), FlowError> {
    let mut exec = Exec::new(cmds);
    let mut trace = Vec::new();
    while trace.len() < STEPS {
        let Some(i) = exec.current(cmds)? else {
            return Ok((trace, true));
        };
        trace.push(cmds[i].gfx_addr);
        exec.advance(cmds)?;
    }
    Ok((trace, false))
}

fn batch_op(batches: usize) -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => Just(Op::Store),
        2 => (0..batches).prop_map(Op::Start),
        2 => (0..batches).prop_map(Op::Call),
        2 => Just(Op::End),
    ]
}

fn ring_op(batches: usize) -> impl Strategy<Value = Op> {
    prop_oneof![
        1 => Just(Op::Store),
        2 => (0..batches).prop_map(Op::Start),
    ]
}

/// Up to 5 batches, each ending in an end or a chain (what follows a chain
/// is laid out but never reached), and a ring that starts them.
fn program() -> impl Strategy<Value = (Vec<Op>, Vec<Vec<Op>>)> {
    (1usize..=5).prop_flat_map(|n| {
        let batch = (
            prop::collection::vec(batch_op(n), 0..6),
            prop_oneof![Just(Op::End), (0..n).prop_map(Op::Start)],
        )
            .prop_map(|(mut ops, last)| {
                ops.push(last);
                ops
            });
        (
            prop::collection::vec(ring_op(n), 1..8),
            prop::collection::vec(batch, n),
        )
    })
}

fn check(ring_ops: &[Op], batch_ops: &[Vec<Op>]) -> Result<bool, TestCaseError> {
    let (p, ring, mut mem) = build(ring_ops, batch_ops);
    let (r, cmds) = run_with(&ring, &cfg(), &mut mem);
    if r.is_err() {
        // Too deep, or another refusal: nothing runs.
        return Ok(false);
    }
    let (want, want_done) = hardware(&p);
    let (got, got_done) = executed(&cmds).map_err(|e| TestCaseError::fail(format!("{e:?}")))?;
    prop_assert_eq!(&got, &want, "{:?}", p);
    prop_assert_eq!(got_done, want_done);
    // Without a start of an audited batch the walk is the list itself.
    let revisits = cmds.iter().any(|c| {
        matches!(
            c.kind,
            Command::BatchStart {
                already_audited: true,
                ..
            }
        )
    });
    if !revisits && want_done {
        let listed: Vec<u64> = cmds.iter().map(|c| c.gfx_addr).collect();
        prop_assert_eq!(got, listed);
    }
    Ok(true)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    #[test]
    fn exec_runs_what_the_hardware_runs((ring_ops, batch_ops) in program()) {
        check(&ring_ops, &batch_ops)?;
    }
}

/// The sequence that made the old engine loop over ring commands: the ring
/// starts A, which chains to B; then starts C, which chains to B again (an
/// audited entry). The hardware runs B's commands a second time and goes
/// on in the ring after C; the old engine ("jump to B, return with the
/// listed command after B's end") went back to the ring after A, ran the
/// ring again and again with the head moving, so its watchdog never fired.
#[test]
fn chain_into_an_audited_batch_from_a_later_batch() {
    use Op::*;
    let ring = [Store, Start(0), Store, Start(2), Store];
    let batches = vec![
        vec![Store, Start(1)],
        vec![Store, End],
        vec![Store, Start(1)],
    ];
    let (p, ring_dw, mut mem) = build(&ring, &batches);
    let (r, cmds) = run_with(&ring_dw, &cfg(), &mut mem);
    r.unwrap();
    let (want, done) = hardware(&p);
    assert!(done);
    assert_eq!(want.len(), 13);
    assert_eq!(executed(&cmds).unwrap(), (want.clone(), true));

    // The old engine's rules, for the record: a start of an audited batch
    // jumps to its first listed command, a call pushes "continue after the
    // call", a first start from the ring or a call pushes "continue with
    // the next listed command", an end pops.
    let mut trace = Vec::new();
    let (mut pc, mut frames) = (0usize, Vec::new());
    while pc < cmds.len() && trace.len() < 100 {
        let c = cmds[pc];
        trace.push(c.gfx_addr);
        pc = match c.kind {
            Command::BatchStart {
                addr,
                second_level,
                level,
                already_audited,
                ..
            } => {
                let call = c.level == 0 || second_level;
                if already_audited {
                    if call {
                        frames.push(Some(pc + 1));
                    }
                    cmds.iter()
                        .position(|x| x.gfx_addr == addr && x.level == level)
                        .unwrap()
                } else {
                    if call {
                        frames.push(None);
                    }
                    pc + 1
                }
            }
            Command::BatchEnd => match frames.pop().unwrap() {
                Some(to) => to,
                None => pc + 1,
            },
            _ => pc + 1,
        };
    }
    assert_eq!(trace.len(), 100, "the old rules never end");
    assert_ne!(trace[..want.len()], want[..]);
}

/// Calls into an audited batch from inside a re-run: the second run of A
/// calls B (audited) and must come back into A, not to the ring.
#[test]
fn nested_reruns_return_where_they_were_called() {
    use Op::*;
    let ring = [Start(0), Start(0), Store];
    let batches = vec![vec![Call(1), Store, Call(1), End], vec![Store, End]];
    let (p, ring_dw, mut mem) = build(&ring, &batches);
    let (r, cmds) = run_with(&ring_dw, &cfg(), &mut mem);
    r.unwrap();
    let (want, done) = hardware(&p);
    assert!(done);
    assert_eq!(executed(&cmds).unwrap(), (want, true));
}

/// A loop through two batches (A chains to B, B back to A) runs on; the
/// ring's later commands are never reached.
#[test]
fn a_chain_loop_runs_on_inside_its_batches() {
    use Op::*;
    let ring = [Start(0), Store];
    let batches = vec![vec![Store, Start(1)], vec![Store, Start(0)]];
    let (p, ring_dw, mut mem) = build(&ring, &batches);
    let (r, cmds) = run_with(&ring_dw, &cfg(), &mut mem);
    r.unwrap();
    let (want, done) = hardware(&p);
    assert!(!done);
    let (got, got_done) = executed(&cmds).unwrap();
    assert!(!got_done);
    assert_eq!(got, want);
    assert!(!got.contains(&p.ring[1].0));
}
