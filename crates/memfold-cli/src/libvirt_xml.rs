//! The domain XML edit behind `memfold libvirt enable` / `disable`: pure functions, the
//! domain's persistent XML in, the new XML out (`virsh dumpxml --inactive` and
//! `virsh define` are the caller's).
//!
//! [`enable`] makes three changes and records them in a `<metadata>` element of memfold's
//! own namespace ([`MEMFOLD_NS`]), so that [`disable`] undoes exactly them:
//!
//! | what | enable | disable |
//! |---|---|---|
//! | `<memoryBacking>` | `<source type='memfd'/>` and `<access mode='shared'/>`, other children kept; added if absent | `<source>` and `<access>` as they were (the original element is copied in the metadata), other children as they are now; the element removed if enable added it and nothing else is in it |
//! | the qemu namespace | `xmlns:qemu` on `<domain>` if missing | removed if enable added it |
//! | `<qemu:commandline>` | `<qemu:env>` `LD_PRELOAD`, `MEMFOLD_SOCKET`, `MEMFOLD_VM_NAME`; with a claim monitor the `-chardev`/`-mon` `<qemu:arg>`s; the element added if absent | those entries removed; the element too if enable added it |
//! | `<metadata>` | `<memfold:libvirt>` with the record; the element added if absent | removed; `<metadata>` too if enable added it |
//!
//! Everything else of the document is written back as it was read, byte for byte
//! (quick-xml events, not a re-serialised tree). Enabling an enabled domain first
//! undoes the old record, so enable is idempotent and takes new settings.

use quick_xml::events::{BytesStart, Event};

mod tree;
use tree::{parse, write, Elem, Node};

/// libvirt's namespace for QEMU pass-through (`<qemu:commandline>`).
pub const QEMU_NS: &str = "http://libvirt.org/schemas/domain/qemu/1.0";
/// memfold's namespace for its record in the domain's `<metadata>`.
pub const MEMFOLD_NS: &str = "https://memfold.invalid/schemas/libvirt/1";
/// The prefix memfold's record is written with.
const MEMFOLD_PREFIX: &str = "memfold";
/// The environment variables enable sets; the agent reads them.
pub const AGENT_ENV: [&str; 3] = ["LD_PRELOAD", "MEMFOLD_SOCKET", "MEMFOLD_VM_NAME"];
/// The chardev id of memfoldd's own monitor (memfold-live's `monitor::MONITOR_ID`).
pub const MONITOR_ID: &str = "memfold-qmp";

/// What enable puts into a domain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// The agent library QEMU preloads (`LD_PRELOAD`).
    pub agent: String,
    /// memfoldd's socket (`MEMFOLD_SOCKET`).
    pub socket: String,
    /// With `Some(path)`: a QMP monitor for memfoldd's balloon claims
    /// (`-chardev socket,id=memfold-qmp,path=PATH,server=on,wait=off -mon ...`).
    pub claim_monitor: Option<String>,
}

/// Why a domain's XML cannot be edited.
#[derive(Debug, thiserror::Error)]
pub enum XmlError {
    /// The text is not well-formed XML.
    #[error("the domain XML is not well-formed at byte {pos}: {message}")]
    Parse {
        /// Byte offset in the input.
        pos: u64,
        /// The parser's message.
        message: String,
    },
    /// The root element is not `<domain>`.
    #[error("the root element is <{0}>, not <domain>")]
    NotADomain(String),
    /// The domain has no `<name>`.
    #[error("the domain XML has no <name>")]
    NoName,
    /// Guest RAM on huge pages: memfold shares 4 KiB pages of a memfd.
    #[error("domain {domain}: <memoryBacking> has <hugepages>; memfold shares 4 KiB pages of a memfd and cannot manage huge-page guest RAM (remove <hugepages> first, or leave this domain unmanaged)")]
    Hugepages {
        /// The domain's name.
        domain: String,
    },
    /// A NUMA cell asks for private memory, which the agent cannot share.
    #[error("domain {domain}: <cpu><numa><cell id='{cell}'> has memAccess='{access}'; that cell's RAM would not be shared memory (remove the memAccess attribute or set it to 'shared')")]
    PrivateCell {
        /// The domain's name.
        domain: String,
        /// The cell's id.
        cell: String,
        /// Its memAccess.
        access: String,
    },
    /// Devices whose back end writes guest RAM outside QEMU's page tables: the agent
    /// leaves such a guest alone (`RamPlan::outside_writers`).
    #[error("domain {domain}: {}: such a device's back end writes guest RAM outside QEMU's page tables, so memfold's agent would leave the guest unmanaged (a write under a shared page would be lost: docs/security.md); remove such devices, or leave this domain unmanaged", .devices.join(", "))]
    OutsideWriters {
        /// The domain's name.
        domain: String,
        /// Each device, as `outside_writers` names it.
        devices: Vec<String>,
    },
    /// Disks whose reads land in guest RAM after QEMU's call returns: the agent leaves
    /// such a guest alone (`RamPlan::unfenced_io`).
    #[error("domain {domain}: {}: QEMU reads such a disk into guest RAM after the submitting call returns, beyond memfold's write fence, so memfold's agent would leave the guest unmanaged; drop the io attribute (QEMU's default, io='threads'), or leave this domain unmanaged", .disks.join(", "))]
    UnfencedDisks {
        /// The domain's name.
        domain: String,
        /// Each disk, as `unfenced_disks` names it.
        disks: Vec<String>,
    },
    /// The domain's `<qemu:commandline>` already sets a variable memfold sets.
    #[error("domain {domain}: <qemu:commandline> already sets {name}='{value}' (not memfold's); memfold would overwrite it: remove it first, or put the agent in by hand (docs/operations.md)")]
    EnvConflict {
        /// The domain's name.
        domain: String,
        /// The variable.
        name: String,
        /// Its value there.
        value: String,
    },
    /// The qemu prefix is bound to another namespace.
    #[error("the prefix 'qemu' is bound to {0}, not {QEMU_NS}")]
    QemuPrefix(String),
    /// `--claim` on a domain without a virtio balloon.
    #[error("domain {domain}: --claim drives the guest's virtio balloon, but <memballoon model='{model}'/>; set model='virtio' or enable without --claim")]
    NoBalloon {
        /// The domain's name.
        domain: String,
        /// The memballoon's model.
        model: String,
    },
    /// memfold's record in `<metadata>` is damaged.
    #[error("memfold's record in <metadata> is damaged: {0}")]
    BadRecord(String),
}

/// What [`enable`] did.
#[derive(Debug, PartialEq, Eq)]
pub struct Enabled {
    /// The new XML.
    pub xml: String,
    /// The domain's name (`MEMFOLD_VM_NAME`).
    pub name: String,
    /// The domain was enabled already (its old record was undone first).
    pub was_enabled: bool,
}

// ---- the edit ----

/// The record's element name, prefixed.
fn rec(name: &str) -> String {
    format!("{MEMFOLD_PREFIX}:{name}")
}

/// The prefix `<domain>` binds to `ns`, if any.
fn prefix_of(root: &Elem, ns: &str) -> Option<String> {
    root.start
        .attributes()
        .with_checks(false)
        .flatten()
        .find_map(|a| {
            let key = a.key.as_ref();
            let p = key.strip_prefix(b"xmlns:")?;
            (a.value.as_ref() == ns.as_bytes()).then(|| String::from_utf8_lossy(p).into_owned())
        })
}

fn domain_name(root: &Elem) -> Result<String, XmlError> {
    root.child("name")
        .map(|n| n.text().trim().to_string())
        .filter(|n| !n.is_empty())
        .ok_or(XmlError::NoName)
}

/// The index of memfold's record among `<metadata>`'s children.
fn record_index(meta: &Elem) -> Option<usize> {
    meta.children.iter().position(
        |n| matches!(n, Node::Elem(e) if e.attr(&format!("xmlns:{MEMFOLD_PREFIX}")).as_deref() == Some(MEMFOLD_NS)),
    )
}

/// Whether `xml` is a domain memfold is enabled on (its record is in `<metadata>`).
pub fn is_enabled(xml: &str) -> Result<bool, XmlError> {
    let doc = parse(xml)?;
    Ok(doc.root.child("metadata").and_then(record_index).is_some())
}

/// The chardev option of the claim monitor at `path` (commas doubled, as QEMU's option
/// syntax wants).
pub fn monitor_chardev(path: &str) -> String {
    format!(
        "socket,id={MONITOR_ID},path={},server=on,wait=off",
        path.replace(',', ",,")
    )
}

/// `qemu:arg` values enable adds for the claim monitor at `path`.
fn monitor_args(path: &str) -> [String; 4] {
    [
        "-chardev".into(),
        monitor_chardev(path),
        "-mon".into(),
        format!("chardev={MONITOR_ID},mode=control"),
    ]
}

/// Where a device is, for a message (` vda`, ` 52:54:00:...`, ` 0000:01:00.0`): its
/// target, its MAC or its host address; empty when it has none of them.
fn whereabouts(e: &Elem) -> String {
    let target = e.child("target");
    let found = target
        .and_then(|t| t.attr("dev").or_else(|| t.attr("dir")))
        .or_else(|| e.child("mac").and_then(|m| m.attr("address")))
        .or_else(|| {
            let a = e.child("source")?.child("address")?;
            a.attr("uuid").or_else(|| {
                // libvirt writes each part in hex with 0x; lspci's form is shorter.
                let part = |k: &str| {
                    let v = a.attr(k)?;
                    Some(v.trim_start_matches("0x").to_string())
                };
                Some(format!(
                    "{}:{}:{}.{}",
                    part("domain")?,
                    part("bus")?,
                    part("slot")?,
                    part("function")?
                ))
            })
        });
    found.map_or_else(String::new, |w| format!(" {w}"))
}

/// The devices of `devices` whose back end writes guest RAM outside QEMU's page tables,
/// as the agent finds them in the QEMU libvirt starts (`-device vfio-*`,
/// `vhost-user-*` but `vhost-user-blk`, `-netdev vhost-user` / `vhost-vdpa`).
fn outside_writers(devices: &Elem) -> Vec<String> {
    let mut out = Vec::new();
    for d in devices.elems() {
        let kind = d.attr("type").unwrap_or_default();
        let at = whereabouts(d);
        let driver = |k: &str| d.child("driver").and_then(|x| x.attr(k));
        let what = match (d.name(), kind.as_str()) {
            // USB and SCSI host devices are QEMU's own (usb-host, vhost-scsi in the kernel).
            (b"hostdev", "pci" | "mdev") => format!("<hostdev type='{kind}'>{at} (VFIO)"),
            (b"interface", "hostdev") => format!("<interface type='hostdev'>{at} (VFIO)"),
            (b"interface", "vhostuser") => format!("<interface type='vhostuser'>{at}"),
            (b"interface", "vdpa") => format!("<interface type='vdpa'>{at}"),
            // QEMU's own VFIO NVMe driver maps all guest RAM into the IOMMU at open.
            (b"disk", "nvme") => format!("<disk type='nvme'>{at} (VFIO)"),
            (b"disk", "vhostvdpa") => format!("<disk type='vhostvdpa'>{at}"),
            (b"filesystem", _) if driver("type").as_deref() == Some("virtiofs") => {
                format!("<filesystem>{at} with <driver type='virtiofs'/>")
            }
            (b"video", _) if driver("name").as_deref() == Some("vhostuser") => {
                "<video> with <driver name='vhostuser'/>".into()
            }
            _ => continue,
        };
        out.push(what);
    }
    out
}

/// The disks of `devices` whose reads land in guest RAM after QEMU's call returns, as the
/// agent finds them (`aio=native`, or `aio=io_uring` with direct I/O: cache `none` or
/// `directsync`).
fn unfenced_disks(devices: &Elem) -> Vec<String> {
    let mut out = Vec::new();
    for d in devices.elems().filter(|d| d.is("disk")) {
        let Some(driver) = d.child("driver") else {
            continue;
        };
        let io = driver.attr("io").unwrap_or_default();
        let cache = driver.attr("cache").unwrap_or_default();
        let direct = matches!(cache.as_str(), "none" | "directsync");
        let at = whereabouts(d);
        if io == "native" {
            out.push(format!("<disk>{at} with <driver io='native'/>"));
        } else if io == "io_uring" && direct {
            out.push(format!(
                "<disk>{at} with <driver io='io_uring' cache='{cache}'/>"
            ));
        }
    }
    out
}

/// Puts memfold into the domain `xml`: shared memfd RAM, the agent in QEMU's
/// environment, optionally the claim monitor, and the record [`disable`] undoes.
///
/// Errors: not a domain, no name, huge pages, a private NUMA cell, a device or disk the
/// agent would leave the guest alone for, a variable of [`AGENT_ENV`] already set by
/// someone else, `--claim` without a virtio balloon.
pub fn enable(xml: &str, s: &Settings) -> Result<Enabled, XmlError> {
    let was_enabled = is_enabled(xml)?;
    let base = if was_enabled {
        disable(xml)?.expect("enabled, so there is a record")
    } else {
        xml.to_string()
    };
    let mut doc = parse(&base)?;
    let name = domain_name(&doc.root)?;
    let root = &mut doc.root;

    // Refusals first: nothing is changed unless everything can be.
    if let Some(mb) = root.child("memoryBacking") {
        if mb.child("hugepages").is_some() {
            return Err(XmlError::Hugepages { domain: name });
        }
    }
    if let Some(numa) = root.child("cpu").and_then(|c| c.child("numa")) {
        for cell in numa.elems().filter(|c| c.is("cell")) {
            if let Some(access) = cell.attr("memAccess").filter(|a| a != "shared") {
                return Err(XmlError::PrivateCell {
                    domain: name,
                    cell: cell.attr("id").unwrap_or_default(),
                    access,
                });
            }
        }
    }
    // What the agent would refuse in QEMU: refused here, where nothing has changed yet.
    if let Some(devices) = root.child("devices") {
        let writers = outside_writers(devices);
        if !writers.is_empty() {
            return Err(XmlError::OutsideWriters {
                domain: name,
                devices: writers,
            });
        }
        let disks = unfenced_disks(devices);
        if !disks.is_empty() {
            return Err(XmlError::UnfencedDisks {
                domain: name,
                disks,
            });
        }
    }
    if s.claim_monitor.is_some() {
        if let Some(model) = root
            .child("devices")
            .and_then(|d| d.child("memballoon"))
            .and_then(|m| m.attr("model"))
            .filter(|m| m != "virtio" && !m.starts_with("virtio-"))
        {
            return Err(XmlError::NoBalloon {
                domain: name,
                model,
            });
        }
    }
    let qemu = match prefix_of(root, QEMU_NS) {
        Some(p) => p,
        None => {
            if let Some(other) = root.attr("xmlns:qemu") {
                return Err(XmlError::QemuPrefix(other));
            }
            "qemu".to_string()
        }
    };
    let q = |n: &str| format!("{qemu}:{n}");
    if let Some(cl) = root.child(&q("commandline")) {
        for env in cl.elems().filter(|e| e.is(&q("env"))) {
            let n = env.attr("name").unwrap_or_default();
            if AGENT_ENV.contains(&n.as_str()) {
                return Err(XmlError::EnvConflict {
                    domain: name,
                    name: n,
                    value: env.attr("value").unwrap_or_default(),
                });
            }
        }
    }

    let mut record =
        Elem::new(&rec("libvirt")).with_attr(&format!("xmlns:{MEMFOLD_PREFIX}"), MEMFOLD_NS);

    // The qemu namespace.
    if prefix_of(root, QEMU_NS).is_none() {
        root.start.push_attribute(("xmlns:qemu", QEMU_NS));
        record = record.with_attr("qemu-namespace", "added");
    }

    // memoryBacking.
    match root.child_mut("memoryBacking") {
        Some(mb) => {
            let mut original = Elem::new(&rec("original"));
            original.append(mb.clone(), 4);
            record.append(original, 3);
            for (child, attr, value) in [("source", "type", "memfd"), ("access", "mode", "shared")]
            {
                match mb.index_of(child) {
                    Some(i) => {
                        mb.children[i] = Node::Elem(Elem::new(child).with_attr(attr, value));
                    }
                    None => mb.append(Elem::new(child).with_attr(attr, value), 2),
                }
            }
        }
        None => {
            let mut mb = Elem::new("memoryBacking");
            mb.append(Elem::new("source").with_attr("type", "memfd"), 2);
            mb.append(Elem::new("access").with_attr("mode", "shared"), 2);
            root.insert_after(&["memory", "currentMemory", "maxMemory"], mb, 1);
            record = record.with_attr("memoryBacking", "added");
        }
    }

    // qemu:commandline.
    let added_cl = root.child(&q("commandline")).is_none();
    if added_cl {
        root.append(Elem::new(&q("commandline")), 1);
        record = record.with_attr("commandline", "added");
    }
    let cl = root.child_mut(&q("commandline")).expect("there now");
    if let Some(path) = &s.claim_monitor {
        for v in monitor_args(path) {
            cl.append(Elem::new(&q("arg")).with_attr("value", &v), 2);
        }
    }
    for (n, v) in [
        ("LD_PRELOAD", s.agent.as_str()),
        ("MEMFOLD_SOCKET", s.socket.as_str()),
        ("MEMFOLD_VM_NAME", name.as_str()),
    ] {
        cl.append(
            Elem::new(&q("env"))
                .with_attr("name", n)
                .with_attr("value", v),
            2,
        );
    }
    if let Some(path) = &s.claim_monitor {
        record = record.with_attr("claim-monitor", path);
    }

    // The record, in <metadata>.
    if root.child("metadata").is_none() {
        root.insert_after(
            &["title", "description", "uuid", "name"],
            Elem::new("metadata"),
            1,
        );
        record = record.with_attr("metadata", "added");
    }
    root.child_mut("metadata")
        .expect("there now")
        .append(record, 2);

    Ok(Enabled {
        xml: write(&doc),
        name,
        was_enabled,
    })
}

/// Takes memfold out of the domain `xml`, undoing what [`enable`] recorded. `Ok(None)`:
/// memfold is not enabled on it (no record), nothing to do.
///
/// Errors: not a domain, or a damaged record.
pub fn disable(xml: &str) -> Result<Option<String>, XmlError> {
    let mut doc = parse(xml)?;
    let root = &mut doc.root;
    let Some(meta) = root.child_mut("metadata") else {
        return Ok(None);
    };
    let Some(ri) = record_index(meta) else {
        return Ok(None);
    };
    let Node::Elem(record) = meta.remove_at(ri) else {
        unreachable!("record_index finds an element")
    };
    let flag = |k: &str| record.attr(k).as_deref() == Some("added");
    if flag("metadata") && meta.elems().next().is_none() {
        let i = root.index_of("metadata").expect("there");
        root.remove_at(i);
    }

    // memoryBacking: only what enable set (`<source>`, `<access>`) goes back to what it
    // was; what the operator changed in it since (`<locked/>`, `<discard/>`...) stays.
    let original = if flag("memoryBacking") {
        None
    } else {
        Some(
            record
                .child(&rec("original"))
                .and_then(|o| o.child("memoryBacking"))
                .ok_or_else(|| {
                    XmlError::BadRecord(
                        "neither memoryBacking='added' nor the original <memoryBacking>".into(),
                    )
                })?
                .clone(),
        )
    };
    match (root.index_of("memoryBacking"), original) {
        (Some(i), original) => {
            let Node::Elem(mb) = &mut root.children[i] else {
                unreachable!("index_of finds an element")
            };
            for child in ["source", "access"] {
                let was = original.as_ref().and_then(|o| o.child(child)).cloned();
                match (mb.index_of(child), was) {
                    (Some(j), Some(was)) => mb.children[j] = Node::Elem(was),
                    (Some(j), None) => {
                        mb.remove_at(j);
                    }
                    (None, Some(was)) => mb.append(was, 2),
                    (None, None) => {}
                }
            }
            // Added by enable and holding nothing of the operator's: gone again.
            if flag("memoryBacking") && mb.elems().next().is_none() {
                root.remove_at(i);
            }
        }
        // Removed since by the operator: the original back, as it was before enable.
        (None, Some(original)) => {
            root.insert_after(&["memory", "currentMemory", "maxMemory"], original, 1)
        }
        (None, None) => {}
    }

    // qemu:commandline.
    if let Some(qemu) = prefix_of(root, QEMU_NS) {
        let q = |n: &str| format!("{qemu}:{n}");
        if let Some(cl) = root.child_mut(&q("commandline")) {
            let ours_env = |e: &Elem| {
                e.is(&q("env")) && AGENT_ENV.contains(&e.attr("name").unwrap_or_default().as_str())
            };
            // Our args: each monitor argument with its flag before it.
            let monitor = record.attr("claim-monitor").map(|p| monitor_args(&p));
            let mut i = 0;
            while i < cl.children.len() {
                let remove = match &cl.children[i] {
                    Node::Elem(e) if ours_env(e) => 1,
                    Node::Elem(e) if e.is(&q("arg")) => match &monitor {
                        Some(args)
                            if e.attr("value").as_deref() == Some(args[0].as_str())
                                || e.attr("value").as_deref() == Some(args[2].as_str()) =>
                        {
                            let next = cl.children[i + 1..].iter().find_map(|n| match n {
                                Node::Elem(e) => Some(e),
                                Node::Other(_) => None,
                            });
                            let value = next.and_then(|n| n.attr("value"));
                            if value.as_deref() == Some(args[1].as_str())
                                || value.as_deref() == Some(args[3].as_str())
                            {
                                2
                            } else {
                                0
                            }
                        }
                        _ => 0,
                    },
                    _ => 0,
                };
                if remove == 0 {
                    i += 1;
                    continue;
                }
                for _ in 0..remove {
                    let j = (i..cl.children.len())
                        .find(|&j| matches!(cl.children[j], Node::Elem(_)))
                        .expect("counted above");
                    cl.remove_at(j);
                }
                i = i.saturating_sub(1);
            }
            if flag("commandline") && cl.elems().next().is_none() {
                let i = root.index_of(&q("commandline")).expect("there");
                root.remove_at(i);
            }
        }
    }

    // The qemu namespace, if enable added it and nothing uses it now.
    if flag("qemu-namespace") && !uses_prefix(root, "qemu") {
        let raw = String::from_utf8_lossy(&root.start).into_owned();
        let name_len = root.name().len();
        root.start = BytesStart::from_content(without_attr(&raw, "xmlns:qemu"), name_len);
    }
    Ok(Some(write(&doc)))
}

/// A start tag's text (`raw`: name and attributes) without the attribute `key` and the
/// whitespace before it, whatever its quotes; the rest as it was.
fn without_attr(raw: &str, key: &str) -> String {
    let b = raw.as_bytes();
    let mut i = 0;
    while let Some(off) = raw[i..].find(key) {
        let at = i + off;
        i = at + key.len();
        // A whole attribute name: whitespace before it, `=` (maybe spaced) after.
        if at == 0 || !b[at - 1].is_ascii_whitespace() {
            continue;
        }
        let mut j = at + key.len();
        while j < b.len() && b[j].is_ascii_whitespace() {
            j += 1;
        }
        if b.get(j) != Some(&b'=') {
            continue;
        }
        j += 1;
        while j < b.len() && b[j].is_ascii_whitespace() {
            j += 1;
        }
        let Some(&quote) = b.get(j).filter(|q| **q == b'"' || **q == b'\'') else {
            continue;
        };
        let Some(close) = raw[j + 1..].find(quote as char) else {
            continue;
        };
        let end = j + 1 + close + 1;
        let mut start = at;
        while start > 0 && b[start - 1].is_ascii_whitespace() {
            start -= 1;
        }
        return format!("{}{}", &raw[..start], &raw[end..]);
    }
    raw.to_string()
}

/// Whether any element under `e` (not `e` itself) is in `prefix`.
fn uses_prefix(e: &Elem, prefix: &str) -> bool {
    let p = format!("{prefix}:");
    e.elems()
        .any(|c| c.name().starts_with(p.as_bytes()) || uses_prefix(c, prefix))
}

/// The domain's name in `xml`.
pub fn name_of(xml: &str) -> Result<String, XmlError> {
    domain_name(&parse(xml)?.root)
}

/// The domain's UUID in `xml` (`<uuid>`; libvirt gives every domain one when it is
/// defined), if it has one.
pub fn uuid_of(xml: &str) -> Result<Option<String>, XmlError> {
    Ok(parse(xml)?
        .root
        .child("uuid")
        .map(|u| u.text().trim().to_string())
        .filter(|u| !u.is_empty()))
}

/// A canonical form of an XML document for comparing two: elements with their attributes
/// sorted, whitespace-only text dropped, text trimmed, one line per node. Two documents
/// libvirt would read alike have the same canonical form.
pub fn canonical(xml: &str) -> Result<String, XmlError> {
    fn walk(n: &Node, depth: usize, out: &mut String) {
        let pad = "  ".repeat(depth);
        match n {
            Node::Elem(e) => {
                let mut attrs: Vec<String> = e
                    .start
                    .attributes()
                    .with_checks(false)
                    .flatten()
                    .map(|a| {
                        format!(
                            "{}={:?}",
                            String::from_utf8_lossy(a.key.as_ref()),
                            a.unescape_value().unwrap_or_default()
                        )
                    })
                    .collect();
                attrs.sort();
                out.push_str(&format!(
                    "{pad}<{} {}>\n",
                    String::from_utf8_lossy(e.name()),
                    attrs.join(" ")
                ));
                let text = e.text();
                if !text.trim().is_empty() {
                    out.push_str(&format!("{pad}  {:?}\n", text.trim()));
                }
                for c in &e.children {
                    walk(c, depth + 1, out);
                }
            }
            Node::Other(Event::Comment(c)) => out.push_str(&format!(
                "{pad}<!--{}-->\n",
                String::from_utf8_lossy(c).trim()
            )),
            Node::Other(_) => {}
        }
    }
    let doc = parse(xml)?;
    let mut out = String::new();
    walk(&Node::Elem(doc.root), 0, &mut out);
    Ok(out)
}

#[cfg(test)]
mod tests;
