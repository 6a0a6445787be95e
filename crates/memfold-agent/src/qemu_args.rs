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

/// QEMU options whose argument matters here: RAM's, the guest's name, disks' I/O, and
/// devices' and network back ends' writers.
const RAM_OPTIONS: [&str; 12] = [
    "object", "machine", "M", "numa", "device", "m", "mem-path", "name", "drive", "blockdev",
    "netdev", "nic",
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
mod tests {
    use super::*;

    fn plan(line: &str) -> RamPlan {
        let words: Vec<&str> = line.split_whitespace().collect();
        RamPlan::parse(&words).unwrap()
    }

    #[test]
    fn drives_whose_reads_land_after_their_call_are_named() {
        assert!(
            plan("-drive file=a.img,if=virtio -drive file=b,cache=none,aio=threads")
                .unfenced_io
                .is_empty()
        );
        assert!(
            plan("-drive file=b,aio=io_uring").unfenced_io.is_empty(),
            "buffered"
        );
        let p =
            plan("-drive file=b,cache=none,aio=native -drive file=c,cache.direct=on,aio=io_uring");
        assert_eq!(
            p.unfenced_io,
            [
                "-drive file=b,cache=none,aio=native",
                "-drive file=c,cache.direct=on,aio=io_uring"
            ]
        );
        let libvirt = [
            "-blockdev",
            r#"{"driver":"file","filename":"/v/d.qcow2","node-name":"f","aio":"io_uring","cache":{"direct":true,"no-flush":false}}"#,
        ];
        assert_eq!(RamPlan::parse(&libvirt).unwrap().unfenced_io.len(), 1);
        // Options of a child node: keyval's dotted keys and nested JSON alike.
        assert_eq!(
            plan("-blockdev driver=qcow2,node-name=q,file.driver=file,file.filename=d,file.aio=native")
                .unfenced_io
                .len(),
            1
        );
        let nested = [
            "-blockdev",
            r#"{"driver":"qcow2","node-name":"q","file":{"driver":"file","filename":"d","aio":"io_uring","cache":{"direct":true}}}"#,
        ];
        assert_eq!(RamPlan::parse(&nested).unwrap().unfenced_io.len(), 1);
        let buffered = [
            "-blockdev",
            r#"{"driver":"qcow2","node-name":"q","file":{"driver":"file","filename":"d","aio":"io_uring"}}"#,
        ];
        assert!(RamPlan::parse(&buffered).unwrap().unfenced_io.is_empty());
    }

    /// Back ends that write guest RAM outside QEMU's page tables are named, in every
    /// spelling (keyval, JSON as libvirt writes it, `-nic`); memfold-blk's
    /// `vhost-user-blk` and the kernel's vhost-net (it writes through QEMU's page tables)
    /// are not.
    #[test]
    fn back_ends_that_write_guest_ram_outside_qemu_are_named() {
        let fine = plan(
            "-chardev socket,id=blk-root,path=/r/blk.sock -device vhost-user-blk-pci,chardev=blk-root \
             -netdev tap,id=n0,vhost=on -device virtio-net-pci,netdev=n0 -nic user,model=virtio",
        );
        assert!(
            fine.outside_writers.is_empty(),
            "{:?}",
            fine.outside_writers
        );
        let p = plan(
            "-device vhost-user-fs-pci,chardev=fs0,tag=share -netdev vhost-user,id=n1,chardev=c1 \
             -device vfio-pci,host=0000:01:00.0 -nic vhost-vdpa,vhostdev=/dev/vhost-vdpa-0 \
             -device vhost-user-gpu-pci,chardev=g",
        );
        assert_eq!(
            p.outside_writers,
            [
                "-device vhost-user-fs-pci,chardev=fs0,tag=share",
                "-netdev vhost-user,id=n1,chardev=c1",
                "-device vfio-pci,host=0000:01:00.0",
                "-nic vhost-vdpa,vhostdev=/dev/vhost-vdpa-0",
                "-device vhost-user-gpu-pci,chardev=g",
            ]
        );
        // QEMU's VFIO NVMe driver, in each spelling.
        for nvme in [
            "-drive file=nvme://0000:01:00.0/1,if=virtio",
            "-blockdev driver=nvme,node-name=n0,device=0000:01:00.0,namespace=1",
            "-blockdev driver=qcow2,node-name=q,file.driver=nvme,file.device=0000:01:00.0",
        ] {
            assert_eq!(plan(nvme).outside_writers, [nvme], "{nvme}");
        }
        let libvirt = [
            "-device",
            r#"{"driver":"vhost-user-fs-pci","id":"fs0","chardev":"chr-vu-fs0","tag":"mount_tag"}"#,
            "-netdev",
            r#"{"type":"vhost-user","chardev":"charnet0","id":"hostnet0"}"#,
        ];
        assert_eq!(RamPlan::parse(&libvirt).unwrap().outside_writers.len(), 2);
    }

    fn problems(line: &str) -> Vec<String> {
        plan(line)
            .problems()
            .iter()
            .map(|p| p.to_string())
            .collect()
    }

    #[test]
    fn shared_memfd_ram_is_accepted_in_every_way_qemu_takes_it() {
        for good in [
            // The launcher's line.
            "-object memory-backend-memfd,id=ram0,size=512M,share=on -machine q35,memory-backend=ram0 -m 512M",
            // share is on by default for a memfd backend; -M and --object spellings.
            "--object memory-backend-memfd,id=r,size=1G -M pc,memory-backend=r -m 1G",
            // Two NUMA nodes, each its own backend.
            "-object memory-backend-memfd,id=m0,size=128M,share=on -object memory-backend-memfd,id=m1,size=64M -m 192M -numa node,memdev=m0 -numa node,memdev=m1",
            // A pc-dimm and a virtio-mem device on memfd backends too.
            "-object memory-backend-memfd,id=ram0,size=256M -machine memory-backend=ram0 -m 256M,slots=2,maxmem=1G -object memory-backend-memfd,id=d1,size=256M -device pc-dimm,id=dimm1,memdev=d1 -object memory-backend-memfd,id=vm0,size=512M -device virtio-mem-pci,id=vmem0,memdev=vm0",
            // libvirt's JSON objects.
            r#"-object {"qom-type":"memory-backend-memfd","id":"pc.ram","size":536870912,"share":true} -machine pc-q35-7.2,memory-backend=pc.ram"#,
        ] {
            let p = plan(good);
            assert_eq!(p.problems(), vec![], "{good}");
            assert!(p.any_shareable_ram(), "{good}");
        }
        let p = plan("-object memory-backend-memfd,id=m0,size=128M,share=on -object memory-backend-memfd,id=m1,size=64M -numa node,memdev=m0 -numa node,memdev=m1");
        assert_eq!(p.shareable_backends(), 2);
        assert_eq!(
            p.used,
            vec![("m0".into(), "numa".into()), ("m1".into(), "numa".into())]
        );
    }

    #[test]
    fn ram_memfold_cannot_read_is_refused_with_the_exact_fix() {
        assert_eq!(
            problems("-machine q35 -m 512M -kernel /k"),
            ["guest RAM is QEMU's anonymous memory (-m 512M without a memory backend); add `-object memory-backend-memfd,id=ram0,size=512M,share=on -machine memory-backend=ram0`"]
        );
        // No -m at all: QEMU's 128 MiB; -m size=... form.
        assert!(problems("-nodefaults")[0].contains("size=128M,share=on"));
        assert!(problems("-m size=2G,slots=4,maxmem=8G")[0].contains("size=2G,share=on"));
        // A size without a unit is MiB to -m but bytes to a backend: the fix says MiB.
        assert_eq!(
            problems("-m 256"),
            ["guest RAM is QEMU's anonymous memory (-m 256M without a memory backend); add `-object memory-backend-memfd,id=ram0,size=256M,share=on -machine memory-backend=ram0`"]
        );
        assert!(problems("-m size=4096,slots=2,maxmem=8G")[0].contains("size=4096M,share=on"));
        assert!(problems("-m 1024 -mem-path /hp")[0].contains("size=1024M,share=on"));
        for (m, size) in [
            ("4G", "4G"),
            ("512M", "512M"),
            ("512m", "512m"),
            ("4096B", "4096B"),
        ] {
            assert_eq!(backend_size(m), size);
        }
        assert_eq!(backend_size("1.5"), "1.5M");
        assert!(problems("-m 1G -mem-path /dev/hugepages")[0]
            .starts_with("guest RAM is the file /dev/hugepages (-mem-path)"));
        assert_eq!(
            problems("-object memory-backend-memfd,id=ram0,size=1G,share=off -machine memory-backend=ram0"),
            ["memory backend ram0 is a private memfd (share=off); define it as `-object memory-backend-memfd,id=ram0,size=1G,share=on`"]
        );
        assert_eq!(
            problems("-object memory-backend-ram,id=ram0,size=1G -machine q35,memory-backend=ram0"),
            ["memory backend ram0 is memory-backend-ram (not a memfd); define it as `-object memory-backend-memfd,id=ram0,size=1G,share=on`"]
        );
        assert!(problems(
            "-object memory-backend-file,id=m0,size=1G,mem-path=/dev/shm/g,share=on -numa node,memdev=m0"
        )[0]
            .contains("memory-backend-file (not a memfd)"));
        assert!(problems(
            "-object memory-backend-memfd,id=ram0,size=2G,hugetlb=on,hugetlbsize=2M -machine memory-backend=ram0"
        )[0]
            .contains("hugetlb=on"));
        assert_eq!(
            problems("-machine memory-backend=nope"),
            ["machine names memory backend nope, which no -object defines; add `-object memory-backend-memfd,id=nope,size=SIZE,share=on`"]
        );
        // One good node and one bad: only the bad one is named, and some RAM is shareable.
        let p = plan("-object memory-backend-memfd,id=m0,size=128M -object memory-backend-ram,id=m1,size=64M -numa node,memdev=m0 -numa node,memdev=m1");
        assert_eq!(p.problems().len(), 1);
        assert!(p.problems()[0].to_string().starts_with("memory backend m1"));
        assert!(p.any_shareable_ram());
        // A memfd defined but never used as RAM does not make -m's RAM shareable.
        let p = plan("-object memory-backend-memfd,id=m0,size=128M -m 128M");
        assert!(!p.any_shareable_ram());
        assert!(matches!(p.problems()[..], [Problem::AnonymousRam { .. }]));
        // A pc-dimm on a memfd does not make the boot RAM shareable either.
        let p = plan("-m 1G,slots=2,maxmem=2G -object memory-backend-memfd,id=d,size=1G -device pc-dimm,memdev=d");
        assert!(matches!(p.problems()[..], [Problem::AnonymousRam { .. }]));
    }

    #[test]
    fn qemus_option_syntax_is_read_as_qemu_reads_it() {
        // `,,` is a comma inside a value; a bare key is on; the first bare item is the type.
        let kv = keyval(
            "memory-backend-memfd,id=a,,b,share,size=1G",
            Some("qom-type"),
        );
        assert_eq!(kv["qom-type"], "memory-backend-memfd");
        assert_eq!(kv["id"], "a,b");
        assert_eq!(kv["share"], "on");
        // Arguments of other options are not mistaken for RAM options.
        let words = [
            "-append",
            "console=ttyS0 -m 4G",
            "-name",
            "guest",
            "-object",
            "memory-backend-memfd,id=r,size=64M",
            "-machine",
            "memory-backend=r",
        ];
        let p = RamPlan::parse(&words).unwrap();
        assert_eq!(p.ram_size, None);
        assert_eq!(p.problems(), vec![]);
        assert_eq!(p.name.as_deref(), Some("guest"));
        // The guest's name, as QEMU reads `-name`: `,,` a comma, `guest=` or the first item.
        let name = |arg: &str| RamPlan::parse(&["-name", arg]).unwrap().name;
        assert_eq!(name("web,,1,debug-threads=on").as_deref(), Some("web,1"));
        assert_eq!(name("debug-threads=on,guest=db").as_deref(), Some("db"));
        assert_eq!(name("debug-threads=on"), None);
        assert_eq!(
            RamPlan::parse(&["-m", "1G", "-object"]).unwrap_err(),
            ArgsError::MissingArgument("-object".into())
        );
        assert!(matches!(
            RamPlan::parse(&["-object", "{not json"]).unwrap_err(),
            ArgsError::BadJson { .. }
        ));
        // Each option names itself, not `-object`.
        let e = RamPlan::parse(&["-blockdev", "{\"driver\":"]).unwrap_err();
        assert!(e.to_string().starts_with("-blockdev {\"driver\""), "{e}");
        // QEMU's single-quoted JSON is QEMU's to take: read, not refused.
        assert!(RamPlan::parse(&["-device", "{'driver':'virtio-net-pci'}"]).is_ok());
        let p = RamPlan::parse(&[
            "-object",
            "{'qom-type':'memory-backend-ram','id':'d0','size':1048576}",
            "-device",
            r#"{'driver':'pc-dimm','memdev':'d0','id':'it\'s "a" dimm'}"#,
        ])
        .unwrap();
        assert_eq!(p.used, vec![("d0".to_string(), "pc-dimm".to_string())]);
    }

    /// libvirt's JSON `-device` (a DIMM on a backend that is no memfd) is read as the
    /// keyval form is: the problem is found, not missed.
    #[test]
    fn a_json_device_names_its_memory_backend() {
        let p = RamPlan::parse(&[
            "-machine",
            "memory-backend=ram0",
            "-object",
            r#"{"qom-type":"memory-backend-memfd","id":"ram0","size":1073741824,"share":true}"#,
            "-object",
            r#"{"qom-type":"memory-backend-ram","id":"dimm0","size":1073741824}"#,
            "-device",
            r#"{"driver":"pc-dimm","memdev":"dimm0","id":"d0"}"#,
        ])
        .unwrap();
        assert!(
            matches!(&p.problems()[..], [Problem::NotMemfd { .. }]),
            "{:?}",
            p.problems()
        );
    }
}
