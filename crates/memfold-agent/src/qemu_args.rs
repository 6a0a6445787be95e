//! QEMU's command line as far as guest RAM goes ([`RamPlan`]): which memory backends it
//! defines, which of them are guest RAM (`-machine memory-backend=`, `-numa node,memdev=`,
//! `-device ...,memdev=` for pc-dimm, nvdimm and virtio-mem), and whether memfold can
//! manage them ([`RamPlan::problems`]: each one says what to write instead).
//!
//! memfold manages guest RAM that is a **shared memfd**: `-object
//! memory-backend-memfd,id=ID,size=SIZE,share=on` (share is on by default for this
//! backend type in QEMU), without `hugetlb=on` (the agent works in 4 KiB pages). Anything
//! else — QEMU's default anonymous RAM (`-m SIZE` alone), `-mem-path`,
//! `memory-backend-ram`, `memory-backend-file`, a memfd with `share=off` — is RAM only
//! QEMU's process can see, which memfoldd cannot read.
//!
//! Read by `memfold qemu` (before QEMU starts: it refuses, printing the fix) and by the
//! agent in QEMU (from `/proc/self/cmdline`: a guest whose RAM is not shareable is left
//! alone at once, with one log line). Pure: no OS access.
//!
//! What is understood: options written `-opt` or `--opt`, their argument as the next
//! word; QEMU's `key=value,...` syntax with `,,` for a comma inside a value and a bare
//! `key` for `key=on`; `-object` also in its JSON form (`-object '{"qom-type": ...}'`, as
//! libvirt writes it). Options this module does not know are skipped with their
//! argument if it does not start with `-`. `-readconfig` files are not read.

use std::collections::BTreeMap;
use std::fmt;

use memfold_wire::keyval::keyval;

/// The memory backend type memfold manages.
pub const MEMFD_BACKEND: &str = "memory-backend-memfd";

/// Size QEMU gives guest RAM when `-m` is absent (QEMU's default, 128 MiB).
const DEFAULT_RAM: &str = "128M";

/// A memory backend object (`-object memory-backend-*`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Backend {
    /// Its `id`.
    pub id: String,
    /// Its QOM type (`memory-backend-memfd`, `memory-backend-ram`, `memory-backend-file`,
    /// ...).
    pub kind: String,
    /// Its `size` as written (`512M`, `1G`, bytes), if given.
    pub size: Option<String>,
    /// Its `share` property if given; QEMU's default is on for a memfd and off otherwise.
    pub share: Option<bool>,
    /// `hugetlb=on`: a memfd of huge pages.
    pub hugetlb: bool,
}

impl Backend {
    /// Whether memfold can manage this backend: a memfd, shared, of 4 KiB pages.
    pub fn shareable(&self) -> bool {
        self.kind == MEMFD_BACKEND && self.share != Some(false) && !self.hugetlb
    }

    /// Its size as written, or `SIZE` when it was not given.
    fn size_text(&self) -> &str {
        self.size.as_deref().unwrap_or("SIZE")
    }
}

/// What the command line says about guest RAM.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RamPlan {
    /// Every memory backend defined, in command-line order (used as RAM or not: QEMU
    /// maps each one when it creates it).
    pub backends: Vec<Backend>,
    /// `-m`'s size as written (`512M`, or the `size=` of `-m size=...,maxmem=...`).
    pub ram_size: Option<String>,
    /// `-mem-path`'s file, if given (file-backed RAM).
    pub mem_path: Option<String>,
    /// Backends used as guest RAM, with what uses each: `machine` (`-machine
    /// memory-backend=`), `numa` (`-numa node,memdev=`) or the `-device` type.
    pub used: Vec<(String, String)>,
    /// `-numa node` entries without `memdev=` (legacy `mem=` or none: QEMU's own RAM).
    pub numa_without_memdev: usize,
    /// The guest's name (`-name NAME` or `-name guest=NAME,...`), if given.
    pub name: Option<String>,
    /// Drives and block nodes (`-drive`, `-blockdev`) whose reads land in guest RAM after
    /// the submitting call returned — `aio=native`, or `aio=io_uring` with direct I/O —
    /// as written: the write fence (`crate::fence`) cannot cover them, so a read racing
    /// a share could be lost. memfold leaves such a guest alone; `aio=threads` (QEMU's
    /// default) is covered.
    pub unfenced_io: Vec<String>,
    /// Devices and network back ends whose other end writes guest RAM outside QEMU's
    /// page tables, as written: a vhost-user back end other than a block device
    /// (virtiofsd, DPDK: they map guest RAM from its memfd in their own process), vDPA,
    /// VFIO (a device's DMA into pages it pinned, QEMU's own NVMe driver's too: a
    /// `-drive`/`-blockdev` of driver `nvme` or file `nvme://`), multi-process QEMU's
    /// `x-pci-proxy-dev`. Their writes under a shared page are
    /// lost, a page reclaimed under them is written where the guest no longer reads, so
    /// memfold leaves such a guest alone. `vhost-user-blk` is taken as memfold-blk's,
    /// which writes through QEMU's page tables (docs/security.md).
    pub outside_writers: Vec<String>,
    /// The user QEMU switches to once it has set up (`-runas USER`, `-run-with user=USER`),
    /// if any: until it has, the process is still root's, and memfoldd would take an agent
    /// connecting then for root's (its domain, no tenant quota) for the connection's life.
    pub runs_as: Option<String>,
}

/// Guest RAM memfold cannot manage, and what to write instead.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Problem {
    /// Guest RAM is QEMU's own anonymous memory: `-m` without a memory backend.
    AnonymousRam {
        /// `-m`'s size (QEMU's default if absent), as a backend's `size=` reads it
        /// ([`backend_size`]: `-m 4096` is `4096M`).
        size: String,
    },
    /// Guest RAM is a file (`-mem-path`).
    MemPath {
        /// The path.
        path: String,
        /// `-m`'s size, as a backend's `size=` reads it ([`backend_size`]).
        size: String,
    },
    /// A backend used as guest RAM is not a memfd.
    NotMemfd {
        /// The backend as defined.
        backend: Backend,
    },
    /// A memfd backend used as guest RAM has `share=off`.
    NotShared {
        /// The backend as defined.
        backend: Backend,
    },
    /// A memfd backend used as guest RAM has `hugetlb=on`.
    Hugetlb {
        /// The backend as defined.
        backend: Backend,
    },
    /// `memdev=` / `memory-backend=` names no `-object` on the command line.
    Undefined {
        /// The id named.
        id: String,
        /// What names it.
        by: String,
    },
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let memfd =
            |id: &str, size: &str| format!("-object {MEMFD_BACKEND},id={id},size={size},share=on");
        match self {
            Problem::AnonymousRam { size } => write!(
                f,
                "guest RAM is QEMU's anonymous memory (-m {size} without a memory backend); add `{} -machine memory-backend=ram0`",
                memfd("ram0", size)
            ),
            Problem::MemPath { path, size } => write!(
                f,
                "guest RAM is the file {path} (-mem-path); drop -mem-path and add `{} -machine memory-backend=ram0`",
                memfd("ram0", size)
            ),
            Problem::NotMemfd { backend: b } => write!(
                f,
                "memory backend {} is {} (not a memfd); define it as `{}`",
                b.id,
                b.kind,
                memfd(&b.id, b.size_text())
            ),
            Problem::NotShared { backend: b } => write!(
                f,
                "memory backend {} is a private memfd (share=off); define it as `{}`",
                b.id,
                memfd(&b.id, b.size_text())
            ),
            Problem::Hugetlb { backend: b } => write!(
                f,
                "memory backend {} is a memfd of huge pages (hugetlb=on; memfold manages 4 KiB pages); define it as `{}`",
                b.id,
                memfd(&b.id, b.size_text())
            ),
            Problem::Undefined { id, by } => write!(
                f,
                "{by} names memory backend {id}, which no -object defines; add `{}`",
                memfd(id, "SIZE")
            ),
        }
    }
}

/// A command-line word memfold cannot read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ArgsError {
    /// An option that needs an argument is the last word.
    #[error("QEMU option {0} has no argument")]
    MissingArgument(String),
    /// A JSON argument (`-object`, `-device`, `-drive`, `-blockdev`) that memfold cannot
    /// read as a JSON object.
    #[error("-{option} {text}: not a JSON object: {why}")]
    BadJson {
        /// The option, without its dash.
        option: String,
        /// The argument.
        text: String,
        /// Why.
        why: String,
    },
}

/// `-m`'s size `m` as a memory backend's `size=` must say it: QEMU reads a size ending in
/// a digit given to `-m` as MiB (`-m 4096` is 4 GiB), but a backend's `size=4096` as
/// bytes; so such a size gets QEMU's own fix-up, an `M` (softmmu/vl.c). Sizes with a unit
/// (`4G`, `512M`, `4096B`) mean the same to both and are kept.
pub fn backend_size(m: &str) -> String {
    if m.ends_with(|c: char| c.is_ascii_digit()) {
        format!("{m}M")
    } else {
        m.to_string()
    }
}

/// QEMU's spellings of a boolean property; `None`: not one.
fn boolean(v: &str) -> Option<bool> {
    match v {
        "on" | "yes" | "true" | "y" => Some(true),
        "off" | "no" | "false" | "n" => Some(false),
        _ => None,
    }
}

/// The values of option `opt` on any node of a block option's `kv` (`aio`, `file.aio`,
/// `file.file.aio`).
fn node_values<'a>(
    kv: &'a BTreeMap<String, String>,
    opt: &'a str,
) -> impl Iterator<Item = &'a str> + 'a {
    kv.iter()
        .filter(move |(k, _)| {
            k.as_str() == opt || (k.ends_with(opt) && k[..k.len() - opt.len()].ends_with('.'))
        })
        .map(|(_, v)| v.as_str())
}

/// A JSON `-object` (libvirt's form) as key=value pairs, values as text.
fn json_object(option: &str, text: &str) -> Result<BTreeMap<String, String>, ArgsError> {
    let bad = |why: String| ArgsError::BadJson {
        option: option.into(),
        text: text.into(),
        why,
    };
    let v: serde_json::Value =
        serde_json::from_str(&double_quoted(text)).map_err(|e| bad(e.to_string()))?;
    let obj = v.as_object().ok_or_else(|| bad("not an object".into()))?;
    let mut out = BTreeMap::new();
    flatten("", obj, &mut out);
    Ok(out)
}

/// `text` with QEMU's single-quoted JSON strings (`{'driver':'pc-dimm'}`, which QEMU's
/// parser takes) written double-quoted, for serde_json; unchanged if it has none.
fn double_quoted(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.contains('\'') {
        return text.into();
    }
    let mut out = String::with_capacity(text.len() + 8);
    let mut chars = text.chars();
    // The quote of the string we are in, if any.
    let mut quote: Option<char> = None;
    while let Some(c) = chars.next() {
        match (quote, c) {
            (None, '"') | (None, '\'') => {
                quote = Some(c);
                out.push('"');
            }
            (Some(q), _) if c == q => {
                quote = None;
                out.push('"');
            }
            (Some(_), '\\') => match chars.next() {
                // `\'` is a plain quote (QEMU's parser takes it in either string).
                Some('\'') => out.push('\''),
                Some(n) => {
                    out.push('\\');
                    out.push(n);
                }
                None => out.push('\\'),
            },
            // A double quote inside a single-quoted string.
            (Some('\''), '"') => out.push_str("\\\""),
            _ => out.push(c),
        }
    }
    out.into()
}

/// `obj`'s members into `out` as QEMU's dotted keys (`{"file":{"aio":"native"}}` as
/// `file.aio`), values as keyval writes them.
fn flatten(
    prefix: &str,
    obj: &serde_json::Map<String, serde_json::Value>,
    out: &mut BTreeMap<String, String>,
) {
    for (k, v) in obj {
        let key = format!("{prefix}{k}");
        let s = match v {
            serde_json::Value::Object(inner) => {
                flatten(&format!("{key}."), inner, out);
                continue;
            }
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Bool(b) => if *b { "on" } else { "off" }.into(),
            serde_json::Value::Number(n) => n.to_string(),
            other => other.to_string(),
        };
        out.insert(key, s);
    }
}

/// QEMU options whose argument matters here: RAM's, the guest's name, disks' I/O,
/// devices' and network back ends' writers, and the user QEMU switches to.
const RAM_OPTIONS: [&str; 14] = [
    "object", "machine", "M", "numa", "device", "m", "mem-path", "name", "drive", "blockdev",
    "netdev", "nic", "runas", "run-with",
];

/// Whether `-device` driver `driver` has another process or a device write guest RAM
/// outside QEMU's page tables (see [`RamPlan::outside_writers`]).
fn writes_outside(driver: &str) -> bool {
    (driver.starts_with("vhost-user-") && !driver.starts_with("vhost-user-blk"))
        || driver.starts_with("vfio-")
        || driver.starts_with("vhost-vdpa")
        || driver == "x-pci-proxy-dev"
}

impl RamPlan {
    /// Reads QEMU's arguments (without the program name).
    ///
    /// Errors: [`ArgsError::MissingArgument`] (`-object` or another RAM option last),
    /// [`ArgsError::BadJson`] (a JSON `-object` that does not parse).
    pub fn parse<S: AsRef<str>>(args: &[S]) -> Result<RamPlan, ArgsError> {
        let mut plan = RamPlan::default();
        let mut i = 0;
        while i < args.len() {
            let word = args[i].as_ref();
            i += 1;
            let Some(opt) = word.strip_prefix("--").or_else(|| word.strip_prefix('-')) else {
                continue;
            };
            if !RAM_OPTIONS.contains(&opt) {
                // An option we do not read: skip its argument if it has one.
                if args.get(i).is_some_and(|a| !a.as_ref().starts_with('-')) {
                    i += 1;
                }
                continue;
            }
            let Some(arg) = args.get(i).map(|a| a.as_ref()) else {
                return Err(ArgsError::MissingArgument(word.into()));
            };
            i += 1;
            match opt {
                "object" => {
                    let kv = if arg.trim_start().starts_with('{') {
                        json_object(opt, arg)?
                    } else {
                        keyval(arg, Some("qom-type"))
                    };
                    let kind = kv.get("qom-type").cloned().unwrap_or_default();
                    if !kind.starts_with("memory-backend-") {
                        continue;
                    }
                    plan.backends.push(Backend {
                        id: kv.get("id").cloned().unwrap_or_default(),
                        kind,
                        size: kv.get("size").cloned(),
                        share: kv.get("share").and_then(|v| boolean(v)),
                        hugetlb: kv.get("hugetlb").and_then(|v| boolean(v)) == Some(true),
                    });
                }
                "machine" | "M" => {
                    if let Some(id) = keyval(arg, Some("type")).get("memory-backend") {
                        plan.used.push((id.clone(), "machine".into()));
                    }
                }
                "numa" => {
                    let kv = keyval(arg, Some("type"));
                    if kv.get("type").map(String::as_str) == Some("node") {
                        match kv.get("memdev") {
                            Some(id) => plan.used.push((id.clone(), "numa".into())),
                            None => plan.numa_without_memdev += 1,
                        }
                    }
                }
                "device" => {
                    // libvirt writes `-device` as JSON (QEMU 6.2 and later take both).
                    let kv = if arg.trim_start().starts_with('{') {
                        json_object(opt, arg)?
                    } else {
                        keyval(arg, Some("driver"))
                    };
                    let driver = kv.get("driver").cloned().unwrap_or_default();
                    if writes_outside(&driver) {
                        plan.outside_writers.push(format!("{word} {arg}"));
                    }
                    if let Some(id) = kv.get("memdev") {
                        plan.used.push((id.clone(), driver));
                    }
                }
                "netdev" | "nic" => {
                    let kv = if arg.trim_start().starts_with('{') {
                        json_object(opt, arg)?
                    } else {
                        keyval(arg, Some("type"))
                    };
                    let kind = kv.get("type").map(String::as_str).unwrap_or_default();
                    if matches!(kind, "vhost-user" | "vhost-vdpa") {
                        plan.outside_writers.push(format!("{word} {arg}"));
                    }
                }
                "m" => {
                    let kv = keyval(arg, Some("size"));
                    plan.ram_size = kv.get("size").cloned();
                }
                "drive" | "blockdev" => {
                    let kv = if arg.trim_start().starts_with('{') {
                        json_object(opt, arg)?
                    } else {
                        keyval(arg, None)
                    };
                    // Any node's options count (`file.aio=`, a nested JSON `file`):
                    // refusing a drive that is fenced after all costs only its saving.
                    let named = |opt: &'static str| node_values(&kv, opt);
                    let direct = named("cache.direct").any(|v| boolean(v) == Some(true))
                        || named("cache").any(|v| matches!(v, "none" | "directsync"));
                    let unfenced = named("aio").any(|v| v == "native")
                        || (direct && named("aio").any(|v| v == "io_uring"));
                    if unfenced {
                        plan.unfenced_io.push(format!("{word} {arg}"));
                    }
                    // QEMU's own VFIO NVMe driver maps all guest RAM into the IOMMU at
                    // open, and a vDPA block device DMAs into it: the device writes reads
                    // into pages it pinned.
                    let nvme = named("driver").any(|v| v == "nvme" || v == "virtio-blk-vhost-vdpa")
                        || named("file").any(|v| v.starts_with("nvme://"))
                        || named("filename").any(|v| v.starts_with("nvme://"));
                    if nvme {
                        plan.outside_writers.push(format!("{word} {arg}"));
                    }
                }
                "mem-path" => plan.mem_path = Some(arg.into()),
                "runas" => plan.runs_as = Some(arg.into()),
                "run-with" => {
                    if let Some(user) = keyval(arg, None).remove("user") {
                        plan.runs_as = Some(user);
                    }
                }
                "name" => {
                    plan.name = keyval(arg, Some("guest"))
                        .remove("guest")
                        .filter(|n| !n.is_empty());
                }
                _ => {}
            }
        }
        Ok(plan)
    }

    /// Whether QEMU's own RAM (not a backend) is guest RAM: no `-machine
    /// memory-backend=` and no `-numa node,memdev=`.
    fn main_ram_is_qemus(&self) -> bool {
        !self
            .used
            .iter()
            .any(|(_, by)| by == "machine" || by == "numa")
            || self.numa_without_memdev > 0
    }

    /// Guest RAM memfold cannot manage, each with the fix; empty: all of it is shareable.
    pub fn problems(&self) -> Vec<Problem> {
        let mut out = Vec::new();
        if self.main_ram_is_qemus() {
            let size = self
                .ram_size
                .as_deref()
                .map_or_else(|| DEFAULT_RAM.into(), backend_size);
            out.push(match &self.mem_path {
                Some(path) => Problem::MemPath {
                    path: path.clone(),
                    size,
                },
                None => Problem::AnonymousRam { size },
            });
        }
        for (id, by) in &self.used {
            let Some(b) = self.backends.iter().find(|b| &b.id == id) else {
                out.push(Problem::Undefined {
                    id: id.clone(),
                    by: by.clone(),
                });
                continue;
            };
            let backend = b.clone();
            if b.kind != MEMFD_BACKEND {
                out.push(Problem::NotMemfd { backend });
            } else if b.share == Some(false) {
                out.push(Problem::NotShared { backend });
            } else if b.hugetlb {
                out.push(Problem::Hugetlb { backend });
            }
        }
        out
    }

    /// Shareable backends QEMU maps at start ([`Backend::shareable`]), used as RAM yet or
    /// not (one defined for a later `device_add` is mapped already).
    pub fn shareable_backends(&self) -> usize {
        self.backends.iter().filter(|b| b.shareable()).count()
    }

    /// Whether some guest RAM is shareable: a shareable backend is used as RAM.
    pub fn any_shareable_ram(&self) -> bool {
        self.used
            .iter()
            .any(|(id, _)| self.backends.iter().any(|b| &b.id == id && b.shareable()))
    }
}

#[cfg(test)]
mod tests;
