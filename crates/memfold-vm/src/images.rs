//! Guest image profiles, built from Debian packages by `images/build.sh` (embedded in
//! the binary) into a cache folder, and reused.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use std::io::{BufRead, BufReader};

/// One buildable guest profile.
#[derive(Clone, Copy, Debug)]
pub struct Profile {
    /// Name used on the command line.
    pub name: &'static str,
    /// Debian release of its userland (`None`: busybox only).
    pub release: Option<&'static str>,
    /// Guest RAM by default, MiB.
    pub mem_mib: u32,
    /// What runs in it.
    pub about: &'static str,
}

/// Every profile.
pub const PROFILES: [Profile; 6] = [
    Profile {
        name: "tiny",
        release: None,
        mem_mib: 192,
        about: "Debian kernel + busybox initramfs, self-check in RAM; boots in seconds (tests)",
    },
    Profile {
        name: "web",
        release: Some("bookworm"),
        mem_mib: 512,
        about: "nginx serving static pages + a curl client loop",
    },
    Profile {
        name: "db",
        release: Some("bookworm"),
        mem_mib: 512,
        about: "postgresql with pgbench, and redis with redis-benchmark",
    },
    Profile {
        name: "py",
        release: Some("bookworm"),
        mem_mib: 512,
        about: "a Python HTTP service computing primes + its client",
    },
    Profile {
        name: "web-trixie",
        release: Some("trixie"),
        mem_mib: 512,
        about: "the web profile on Debian trixie",
    },
    Profile {
        name: "py-trixie",
        release: Some("trixie"),
        mem_mib: 512,
        about: "the py profile on Debian trixie",
    },
];

/// Image errors.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// Not a profile name.
    #[error("unknown image profile '{0}' (known: tiny, web, db, py, web-trixie, py-trixie)")]
    UnknownProfile(String),
    /// The profile has not been built.
    #[error(
        "image '{profile}' is not built ({missing} missing): run `memfold image build {profile}`"
    )]
    NotBuilt {
        /// Profile.
        profile: String,
        /// The missing file.
        missing: PathBuf,
    },
    /// The build script failed.
    #[error("building image '{profile}' failed ({status}): {tail}")]
    BuildFailed {
        /// Profile.
        profile: String,
        /// Exit status.
        status: String,
        /// Last lines of its output.
        tail: String,
    },
    /// I/O on the cache folder.
    #[error("image cache {path}: {source}")]
    Io {
        /// Path.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
}

/// Looks a profile up by name.
pub fn profile(name: &str) -> Result<Profile, ImageError> {
    PROFILES
        .iter()
        .copied()
        .find(|p| p.name == name)
        .ok_or_else(|| ImageError::UnknownProfile(name.into()))
}

/// The image cache: `$MEMFOLD_IMAGES`, else `~/.cache/memfold/images`.
pub fn cache_dir() -> PathBuf {
    std::env::var_os("MEMFOLD_IMAGES")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into()))
                .join(".cache/memfold/images")
        })
}

/// A built image's files.
#[derive(Clone, Debug)]
pub struct Image {
    /// The profile.
    pub profile: Profile,
    /// Kernel.
    pub kernel: PathBuf,
    /// Initramfs.
    pub initrd: PathBuf,
    /// Root file system (ext4), for Debian profiles.
    pub rootfs: Option<PathBuf>,
}

/// The built image of `name` in `cache`.
///
/// Errors: [`ImageError::UnknownProfile`], [`ImageError::NotBuilt`].
pub fn image(cache: &Path, name: &str) -> Result<Image, ImageError> {
    let profile = profile(name)?;
    let dir = cache.join(name);
    let need = |f: &str| {
        let p = dir.join(f);
        if p.exists() {
            Ok(p)
        } else {
            Err(ImageError::NotBuilt {
                profile: name.into(),
                missing: p,
            })
        }
    };
    need("profile")?;
    // An image built from other recipes (an older memfold) is stale: rebuild it.
    let recipe = dir.join("recipe");
    if std::fs::read_to_string(&recipe).ok().as_deref() != Some(recipe_fingerprint().as_str()) {
        return Err(ImageError::NotBuilt {
            profile: name.into(),
            missing: recipe,
        });
    }
    Ok(Image {
        profile,
        kernel: need("vmlinuz")?,
        initrd: need("initrd.img")?,
        rootfs: profile.release.map(|_| need("rootfs.ext4")).transpose()?,
    })
}

const SCRIPTS: [(&str, &str); 9] = [
    ("build.sh", include_str!("../../../images/build.sh")),
    ("tiny-init", include_str!("../../../images/tiny-init")),
    ("disk-init", include_str!("../../../images/disk-init")),
    ("guest-init", include_str!("../../../images/guest-init")),
    ("selfcheck.sh", include_str!("../../../images/selfcheck.sh")),
    (
        "mechanism-data",
        include_str!("../../../images/mechanism-data"),
    ),
    // The probe's source: the binary below is built from it (fingerprinted by source, so
    // builds in other target folders agree on the image).
    (
        "memfold-probe.rs",
        include_str!("../../../images/memfold-probe.rs"),
    ),
    // The enlightened guest's agent, likewise.
    (
        "memfold-guest.rs",
        include_str!("../../../images/memfold-guest.rs"),
    ),
    (
        "memfold-guest-marks.rs",
        include_str!("../../../images/memfold-guest-marks.rs"),
    ),
];

/// The side-channel probe the `tiny` image carries in `/bin` (images/memfold-probe.rs,
/// built statically by this crate's build script; docs/side-channel.md).
const PROBE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/memfold-probe"));

/// The enlightened guest's agent the `tiny` image carries in `/bin` and starts at boot
/// (images/memfold-guest.rs, built statically by this crate's build script; issue 17,
/// docs/enlightened.md).
const GUEST_AGENT: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/memfold-guest"));

/// Fingerprint of the build recipes (xxh3 over the embedded scripts and their names),
/// stored in an image's `recipe` file: an image whose recipes changed is rebuilt.
fn recipe_fingerprint() -> String {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for (file, text) in SCRIPTS {
        h.update(file.as_bytes());
        h.update(&[0]);
        h.update(text.as_bytes());
    }
    format!("{:016x}\n", h.digest())
}

/// Builds (or reuses) the image of `name` in `cache`, calling `progress` with each step
/// line of the build script. Reuses a complete image without running anything.
///
/// Errors: [`ImageError::UnknownProfile`], [`ImageError::BuildFailed`], [`ImageError::Io`].
pub fn build(
    cache: &Path,
    name: &str,
    mut progress: impl FnMut(&str),
) -> Result<Image, ImageError> {
    profile(name)?;
    if let Ok(img) = image(cache, name) {
        progress(&format!("== step: cached: {}", cache.join(name).display()));
        return Ok(img);
    }
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ImageError::Io { path, source }
    };
    // One build at a time per cache (profiles share the kernel download): another process
    // or thread building the same image makes this wait, then finds it built.
    std::fs::create_dir_all(cache).map_err(io(cache))?;
    let lock_path = cache.join(".build.lock");
    let lock = std::fs::File::create(&lock_path).map_err(io(&lock_path))?;
    rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive)
        .map_err(|e| io(&lock_path)(e.into()))?;
    if let Ok(img) = image(cache, name) {
        progress(&format!(
            "== step: built meanwhile: {}",
            cache.join(name).display()
        ));
        return Ok(img);
    }
    let scripts = cache.join("scripts");
    std::fs::create_dir_all(&scripts).map_err(io(&scripts))?;
    for (file, text) in SCRIPTS {
        let p = scripts.join(file);
        std::fs::write(&p, text).map_err(io(&p))?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).map_err(io(&p))?;
    }
    for (file, bytes) in [("memfold-probe", PROBE), ("memfold-guest", GUEST_AGENT)] {
        let p = scripts.join(file);
        std::fs::write(&p, bytes).map_err(io(&p))?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).map_err(io(&p))?;
    }
    let mut child = Command::new("bash")
        .arg(scripts.join("build.sh"))
        .arg(name)
        .arg(cache.join(name))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(io(&scripts))?;
    let stderr = child.stderr.take().expect("piped");
    let err_thread = std::thread::spawn(move || {
        let mut lines: Vec<String> = BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
            .collect();
        let n = lines.len();
        lines.drain(..n.saturating_sub(15));
        lines.join("\n")
    });
    for line in BufReader::new(child.stdout.take().expect("piped"))
        .lines()
        .map_while(Result::ok)
    {
        progress(&line);
    }
    let status = child.wait().map_err(io(&scripts))?;
    let tail = err_thread.join().unwrap_or_default();
    if !status.success() {
        return Err(ImageError::BuildFailed {
            profile: name.into(),
            status: status.to_string(),
            tail,
        });
    }
    let recipe = cache.join(name).join("recipe");
    std::fs::write(&recipe, recipe_fingerprint()).map_err(io(&recipe))?;
    image(cache, name)
}
