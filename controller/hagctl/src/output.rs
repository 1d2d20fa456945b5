//! What hagctl prints: status as a table or one JSON object, events as one
//! line each. Pure functions of values, so the exact text is tested.

use hag_abi::abi::{self, HagVgpuInfo, HagVgpuStats};
use hag_dev::ModuleInfo;
use serde::Serialize;

use crate::events::Event;

/// A UUID in its canonical text form.
pub fn uuid_text(uuid: &[u8; 16]) -> String {
    let mut out = [0u8; 36];
    abi::format_uuid(uuid, &mut out);
    out.iter().copied().map(char::from).collect()
}

/// Names of the feature bits; bits this build does not know are shown as
/// hex so a newer module's features are visible rather than hidden.
pub fn feature_names(features: u32) -> Vec<String> {
    let mut names: Vec<String> = abi::FEATURES
        .iter()
        .filter(|(bit, _)| features & bit != 0)
        .map(|(_, name)| (*name).to_owned())
        .collect();
    let unknown = abi::FEATURES
        .iter()
        .fold(features, |rest, (bit, _)| rest & !bit);
    if unknown != 0 {
        names.push(format!("unknown({unknown:#x})"));
    }
    names
}

/// A byte count in the largest binary unit that divides it exactly, so the
/// number shown is never rounded.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [(u32, &str); 4] = [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")];
    UNITS
        .iter()
        .find(|(shift, _)| bytes != 0 && bytes.trailing_zeros() >= *shift)
        .map_or_else(
            || format!("{bytes} B"),
            |(shift, unit)| format!("{} {unit}", bytes >> shift),
        )
}

/// A vGPU's counters on one line, as `hagctl status` shows them under its
/// row (`None`: the vGPU went away before its counters were read).
/// "precise" and "fallback" count workloads whose write set was modelled
/// exactly and those for which every page the vGPU can reach was marked
/// instead (GVT-g; a hag-sim vGPU has no fallback).
pub fn stats_text(stats: Option<&HagVgpuStats>) -> String {
    match stats {
        Some(s) => format!(
            "submissions {}, rejected {}, precise {}, fallback {}, commands {}, pages marked {}, interrupts {}, hangs {}, watchdog {} ms",
            s.submissions,
            s.rejected,
            s.precise_workloads,
            s.fallback_workloads,
            s.commands,
            s.pages_marked,
            s.interrupts,
            s.hangs,
            s.watchdog_ms
        ),
        None => "no counters (the vGPU went away)".to_owned(),
    }
}

/// `hagctl status` as text: a version line, a count line, then a table
/// with a second line of counters per vGPU. `stats[i]` belongs to
/// `vgpus[i]` (missing entries show as unavailable).
pub fn status_text(
    module: &ModuleInfo,
    vgpus: &[HagVgpuInfo],
    stats: &[Option<HagVgpuStats>],
) -> String {
    let version = if module.module_version.is_empty() {
        "(no version)"
    } else {
        &module.module_version
    };
    let features = feature_names(module.features);
    let features = if features.is_empty() {
        "none".to_owned()
    } else {
        features.join(", ")
    };
    let mut out = format!(
        "hag_mdev {version}, ABI {}, features: {features}\n",
        module.abi_version
    );
    match vgpus.len() {
        0 => {
            out.push_str("no vGPUs\n");
            return out;
        }
        1 => out.push_str("1 vGPU\n"),
        n => out.push_str(&format!("{n} vGPUs\n")),
    }

    let header = ["ID", "UUID", "SOURCE", "STATE", "GFX-MEM"].map(String::from);
    let rows: Vec<[String; 5]> = vgpus
        .iter()
        .map(|v| {
            [
                v.id.to_string(),
                uuid_text(&v.uuid),
                abi::source_name(v.source).to_owned(),
                abi::state_name(v.state).to_owned(),
                format_size(v.gfx_mem_size),
            ]
        })
        .collect();
    let mut widths = [0; 5];
    for row in std::iter::once(&header).chain(&rows) {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.len());
        }
    }
    for (i, row) in std::iter::once(&header).chain(&rows).enumerate() {
        let line = format!(
            "  {:>w0$}  {:<w1$}  {:<w2$}  {:<w3$}  {}",
            row[0],
            row[1],
            row[2],
            row[3],
            row[4],
            w0 = widths[0],
            w1 = widths[1],
            w2 = widths[2],
            w3 = widths[3],
        );
        out.push_str(&line);
        out.push('\n');
        if i > 0 {
            // Under the UUID column.
            let counters = stats_text(stats.get(i - 1).and_then(Option::as_ref));
            out.push_str(&format!("  {:w0$}  {counters}\n", "", w0 = widths[0]));
        }
    }
    out
}

#[derive(Serialize)]
struct StatusJson<'a> {
    abi_version: u32,
    module_version: &'a str,
    features: Vec<String>,
    vgpus: Vec<VgpuJson>,
}

#[derive(Serialize)]
struct VgpuJson {
    id: u32,
    uuid: String,
    source: &'static str,
    state: &'static str,
    gfx_mem_size: u64,
    stats: Option<StatsJson>,
}

#[derive(Serialize)]
struct StatsJson {
    submissions: u64,
    rejected: u64,
    precise_workloads: u64,
    fallback_workloads: u64,
    commands: u64,
    pages_marked: u64,
    interrupts: u64,
    hangs: u64,
    watchdog_ms: u32,
}

impl From<&HagVgpuStats> for StatsJson {
    fn from(s: &HagVgpuStats) -> Self {
        StatsJson {
            submissions: s.submissions,
            rejected: s.rejected,
            precise_workloads: s.precise_workloads,
            fallback_workloads: s.fallback_workloads,
            commands: s.commands,
            pages_marked: s.pages_marked,
            interrupts: s.interrupts,
            hangs: s.hangs,
            watchdog_ms: s.watchdog_ms,
        }
    }
}

/// `hagctl status --json`: one JSON object on one line; each vGPU has a
/// "stats" object (`null` if the vGPU went away before it was read).
pub fn status_json(
    module: &ModuleInfo,
    vgpus: &[HagVgpuInfo],
    stats: &[Option<HagVgpuStats>],
) -> String {
    let status = StatusJson {
        abi_version: module.abi_version,
        module_version: &module.module_version,
        features: feature_names(module.features),
        vgpus: vgpus
            .iter()
            .enumerate()
            .map(|(i, v)| VgpuJson {
                id: v.id,
                uuid: uuid_text(&v.uuid),
                source: abi::source_name(v.source),
                state: abi::state_name(v.state),
                gfx_mem_size: v.gfx_mem_size,
                stats: stats.get(i).and_then(Option::as_ref).map(StatsJson::from),
            })
            .collect(),
    };
    json_line(&status)
}

/// `hagctl events`: `NAME [vgpu=ID] [uuid=UUID] [message="TEXT"]`. The
/// message is quoted and escaped so an event is always exactly one line.
pub fn event_text(event: &Event) -> String {
    let mut line = abi::event_name(event.kind).to_owned();
    if !is_known_event(event.kind) {
        line.push_str(&format!(" kind={}", event.kind));
    }
    if let Some(id) = event.vgpu_id {
        line.push_str(&format!(" vgpu={id}"));
    }
    if let Some(uuid) = &event.uuid {
        line.push_str(&format!(" uuid={}", uuid_text(uuid)));
    }
    if let Some(message) = &event.message {
        line.push_str(&format!(" message={message:?}"));
    }
    line
}

#[derive(Serialize)]
struct EventJson<'a> {
    event: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    kind: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    vgpu: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    uuid: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    timestamp_ns: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    message: Option<&'a str>,
}

/// `hagctl events --json`: one object per line; absent fields are left out,
/// and `kind` (the number) appears only when the name is `unknown`.
pub fn event_json(event: &Event) -> String {
    json_line(&EventJson {
        event: abi::event_name(event.kind),
        kind: (!is_known_event(event.kind)).then_some(event.kind),
        vgpu: event.vgpu_id,
        uuid: event.uuid.as_ref().map(uuid_text),
        timestamp_ns: event.timestamp_ns,
        message: event.message.as_deref(),
    })
}

fn is_known_event(kind: u32) -> bool {
    abi::event_name(kind) != abi::event_name(0)
}

fn json_line<T: Serialize>(value: &T) -> String {
    // Only strings, numbers and vectors of them: serialising cannot fail.
    serde_json::to_string(value).expect("plain data serialises")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn module() -> ModuleInfo {
        ModuleInfo {
            abi_version: abi::ABI_VERSION,
            features: abi::FEATURE_SIM_VGPU,
            module_version: "0.1.0".into(),
        }
    }

    fn vgpu(id: u32, last: u8, state: u32) -> HagVgpuInfo {
        let mut uuid = [
            0x83, 0xb8, 0xf4, 0xf2, 0x50, 0x9f, 0x38, 0x2f, 0x3c, 0x1e, 0xe6, 0xbf, 0xe0, 0xfa,
            0x10, 0x00,
        ];
        uuid[15] = last;
        HagVgpuInfo {
            id,
            source: abi::VGPU_SOURCE_SIM,
            state,
            reserved: 0,
            uuid,
            gfx_mem_size: abi::SIM_GFX_MEM_SIZE,
        }
    }

    fn stats(id: u32, n: u64) -> HagVgpuStats {
        HagVgpuStats {
            vgpu_id: id,
            state: abi::VGPU_STATE_OPEN,
            submissions: n,
            rejected: 1,
            commands: 66 * n,
            pages_marked: 16 * n + 1,
            interrupts: n,
            hangs: 2,
            watchdog_ms: 2000,
            reserved: 0,
            bytes_written: 0,
            precise_workloads: n.saturating_sub(1),
            fallback_workloads: n / 4,
        }
    }

    #[test]
    fn status_text_with_two_vgpus() {
        let vgpus = [
            vgpu(1, 0x01, abi::VGPU_STATE_IDLE),
            vgpu(2, 0x02, abi::VGPU_STATE_OPEN),
        ];
        assert_eq!(
            status_text(&module(), &vgpus, &[Some(stats(1, 0)), Some(stats(2, 8))]),
            "hag_mdev 0.1.0, ABI 3, features: sim\n\
             2 vGPUs\n\
             \x20 ID  UUID                                  SOURCE  STATE  GFX-MEM\n\
             \x20  1  83b8f4f2-509f-382f-3c1e-e6bfe0fa1001  sim     idle   64 MiB\n\
             \x20     submissions 0, rejected 1, precise 0, fallback 0, commands 0, pages marked 1, interrupts 0, hangs 2, watchdog 2000 ms\n\
             \x20  2  83b8f4f2-509f-382f-3c1e-e6bfe0fa1002  sim     open   64 MiB\n\
             \x20     submissions 8, rejected 1, precise 7, fallback 2, commands 528, pages marked 129, interrupts 8, hangs 2, watchdog 2000 ms\n"
        );
    }

    #[test]
    fn status_text_when_counters_are_missing() {
        let vgpus = [vgpu(12, 0x01, abi::VGPU_STATE_IDLE)];
        assert_eq!(
            status_text(&module(), &vgpus, &[None]),
            "hag_mdev 0.1.0, ABI 3, features: sim\n\
             1 vGPU\n\
             \x20 ID  UUID                                  SOURCE  STATE  GFX-MEM\n\
             \x20 12  83b8f4f2-509f-382f-3c1e-e6bfe0fa1001  sim     idle   64 MiB\n\
             \x20     no counters (the vGPU went away)\n"
        );
        // A short stats slice is the same as missing counters.
        assert_eq!(
            status_text(&module(), &vgpus, &[]),
            status_text(&module(), &vgpus, &[None])
        );
    }

    #[test]
    fn status_text_with_no_vgpus() {
        let mut m = module();
        m.features = 0;
        assert_eq!(
            status_text(&m, &[], &[]),
            "hag_mdev 0.1.0, ABI 3, features: none\nno vGPUs\n"
        );
    }

    #[test]
    fn status_json_with_two_vgpus() {
        let vgpus = [
            vgpu(1, 0x01, abi::VGPU_STATE_IDLE),
            vgpu(2, 0x02, abi::VGPU_STATE_OPEN),
        ];
        assert_eq!(
            status_json(&module(), &vgpus, &[Some(stats(1, 8)), None]),
            r#"{"abi_version":3,"module_version":"0.1.0","features":["sim"],"vgpus":[{"id":1,"uuid":"83b8f4f2-509f-382f-3c1e-e6bfe0fa1001","source":"sim","state":"idle","gfx_mem_size":67108864,"stats":{"submissions":8,"rejected":1,"precise_workloads":7,"fallback_workloads":2,"commands":528,"pages_marked":129,"interrupts":8,"hangs":2,"watchdog_ms":2000}},{"id":2,"uuid":"83b8f4f2-509f-382f-3c1e-e6bfe0fa1002","source":"sim","state":"open","gfx_mem_size":67108864,"stats":null}]}"#
        );
    }

    #[test]
    fn status_json_with_no_vgpus() {
        assert_eq!(
            status_json(&module(), &[], &[]),
            r#"{"abi_version":3,"module_version":"0.1.0","features":["sim"],"vgpus":[]}"#
        );
    }

    #[test]
    fn sizes_use_the_largest_exact_unit() {
        assert_eq!(format_size(0), "0 B");
        assert_eq!(format_size(1000), "1000 B");
        assert_eq!(format_size(4096), "4 KiB");
        assert_eq!(format_size(64 << 20), "64 MiB");
        assert_eq!(format_size(1536 << 20), "1536 MiB");
        assert_eq!(format_size(2 << 30), "2 GiB");
        assert_eq!(format_size((64 << 20) + 1), "67108865 B");
    }

    #[test]
    fn unknown_feature_bits_are_shown() {
        assert_eq!(
            feature_names(abi::FEATURE_SIM_VGPU | abi::FEATURE_GVT | 0x100),
            ["sim", "gvt", "unknown(0x100)"]
        );
    }

    fn event() -> Event {
        Event {
            kind: abi::EVENT_VGPU_CREATED,
            vgpu_id: Some(1),
            uuid: Some(vgpu(1, 0x01, 0).uuid),
            timestamp_ns: Some(42),
            message: Some("say \"hi\"\nbye".into()),
        }
    }

    #[test]
    fn event_text_is_one_line() {
        assert_eq!(
            event_text(&event()),
            r#"vgpu-created vgpu=1 uuid=83b8f4f2-509f-382f-3c1e-e6bfe0fa1001 message="say \"hi\"\nbye""#
        );
        let bare = Event {
            kind: 77,
            vgpu_id: None,
            uuid: None,
            timestamp_ns: None,
            message: None,
        };
        assert_eq!(event_text(&bare), "unknown kind=77");
    }

    #[test]
    fn event_json_leaves_out_absent_fields() {
        assert_eq!(
            event_json(&event()),
            r#"{"event":"vgpu-created","vgpu":1,"uuid":"83b8f4f2-509f-382f-3c1e-e6bfe0fa1001","timestamp_ns":42,"message":"say \"hi\"\nbye"}"#
        );
        let bare = Event {
            kind: 77,
            vgpu_id: None,
            uuid: None,
            timestamp_ns: None,
            message: None,
        };
        assert_eq!(event_json(&bare), r#"{"event":"unknown","kind":77}"#);
    }
}
