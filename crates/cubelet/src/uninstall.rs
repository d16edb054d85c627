//! `cubelet uninstall`: removes what a Cubelet left on the host, so that a
//! package removal (or an operator) leaves nothing of Cubelet's behind.
//!
//! From the configuration it reads (or the defaults) it removes, in order:
//! every task, container, image, lease, content blob and snapshot in
//! Cubelet's containerd namespace, and the namespace (through `ctr`, which
//! ships with containerd); every mount under the state and root
//! directories (deepest first, detached); loop devices backed by files
//! under the root directory; the bridge provider's veths, bridge and nft
//! table; the CRI socket; the state and root directories. Each step
//! tolerates "already gone", so a re-run finishes an interrupted one. It
//! refuses to run while an agent answers on the admin socket: a live agent
//! would recreate what is being removed.
//!
//! Files under `/etc/cubelet` are the package manager's (conffiles) or the
//! operator's, and are left alone.

use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::config::{Config, NetworkProvider};

/// Why an uninstall step failed.
#[derive(Debug, thiserror::Error)]
pub enum UninstallError {
    /// A Cubelet answers on its admin socket.
    #[error("a Cubelet is running (its admin socket {0} answers): stop it first, e.g. `systemctl stop cubelet`")]
    Running(PathBuf),
    /// A directory is not one Cubelet could own (`/`, `/var`, relative …).
    #[error("refusing to remove {0}: not a dedicated absolute directory")]
    UnsafePath(PathBuf),
    /// A helper program could not be started.
    #[error("cannot run {program}")]
    Spawn {
        /// The program.
        program: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A helper program failed.
    #[error("`{command}` failed: {stderr}")]
    Command {
        /// The command line.
        command: String,
        /// What it printed on stderr.
        stderr: String,
    },
    /// A file system call failed.
    #[error("{what} {path}")]
    Io {
        /// The operation.
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
}

/// What one run did: a line per thing removed, and the steps that failed.
#[derive(Debug, Default)]
pub struct Report {
    /// One line per thing removed.
    pub removed: Vec<String>,
    /// Steps that failed; the others still ran.
    pub failed: Vec<UninstallError>,
}

/// Removes what the Cubelet configured by `config` left on this host.
/// `Err` only when nothing was done (a running agent); otherwise the
/// report lists what was removed and what failed.
pub fn run(config: &Config) -> Result<Report, UninstallError> {
    let admin = config.state_dir.join("admin.sock");
    if std::os::unix::net::UnixStream::connect(&admin).is_ok() {
        return Err(UninstallError::Running(admin));
    }
    let mut report = Report::default();
    let steps: [(&str, StepFn); 6] = [
        ("containerd objects", containerd_objects),
        ("mounts", mounts),
        ("loop devices", loop_devices),
        ("network", network),
        ("socket", socket),
        ("directories", directories),
    ];
    for (name, step) in steps {
        tracing::debug!(step = name, "uninstall step");
        if let Err(e) = step(config, &mut report.removed) {
            report.failed.push(e);
        }
    }
    Ok(report)
}

type StepFn = fn(&Config, &mut Vec<String>) -> Result<(), UninstallError>;

/// Runs `program args…`; its stdout, or an error naming the command.
fn output(program: &str, args: &[&str]) -> Result<String, UninstallError> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|source| UninstallError::Spawn {
            program: program.to_string(),
            source,
        })?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(UninstallError::Command {
            command: format!("{program} {}", args.join(" ")),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

/// Every object in Cubelet's containerd namespace, then the namespace.
fn containerd_objects(config: &Config, removed: &mut Vec<String>) -> Result<(), UninstallError> {
    let address = config.containerd.address.to_string_lossy().into_owned();
    let ns = config.containerd.namespace.as_str();
    if !config.containerd.address.exists() {
        tracing::info!(%address, "no containerd socket: no containerd objects to remove");
        return Ok(());
    }
    let namespaces = output("ctr", &["--address", &address, "namespaces", "ls", "-q"])?;
    if !namespaces.lines().any(|l| l.trim() == ns) {
        return Ok(());
    }
    let ctr = |args: &[&str]| -> Result<String, UninstallError> {
        let mut all = vec!["--address", address.as_str(), "--namespace", ns];
        all.extend_from_slice(args);
        output("ctr", &all)
    };
    let ids = |kind: &str| -> Result<Vec<String>, UninstallError> {
        Ok(ctr(&[kind, "ls", "-q"])?
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect())
    };
    for task in ids("tasks")? {
        ctr(&["tasks", "delete", "--force", &task])?;
        removed.push(format!("containerd task {ns}/{task}"));
    }
    for container in ids("containers")? {
        ctr(&["containers", "delete", &container])?;
        removed.push(format!("containerd container {ns}/{container}"));
    }
    for image in ids("images")? {
        ctr(&["images", "delete", "--sync", &image])?;
        removed.push(format!("containerd image {ns}/{image}"));
    }
    for lease in ids("leases")? {
        ctr(&["leases", "delete", &lease])?;
    }
    // Snapshots form chains: a parent goes only after its children, so
    // sweep until a pass removes nothing.
    loop {
        let snapshots = snapshot_keys(&ctr(&["snapshots", "ls"])?);
        let before = snapshots.len();
        for key in &snapshots {
            let _ = ctr(&["snapshots", "delete", key]);
        }
        let after = snapshot_keys(&ctr(&["snapshots", "ls"])?).len();
        if after == 0 || after == before {
            break;
        }
    }
    for blob in ids("content")? {
        let _ = ctr(&["content", "delete", &blob]);
    }
    // containerd's garbage collector runs after deletions; an emptied
    // namespace can be deleted once it has.
    let mut last = None;
    for _ in 0..50 {
        match ctr(&["namespaces", "remove", ns]) {
            Ok(_) => {
                removed.push(format!("containerd namespace {ns}"));
                return Ok(());
            }
            Err(e) => last = Some(e),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    last.map_or(Ok(()), Err)
}

/// Snapshot keys from `ctr snapshots ls` (a header line, then `KEY PARENT KIND`).
fn snapshot_keys(listing: &str) -> Vec<String> {
    listing
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

/// Unmounts (detached, deepest first) everything under the state and root
/// directories: netns and IPC/UTS pins, shm, scratch file systems.
fn mounts(config: &Config, removed: &mut Vec<String>) -> Result<(), UninstallError> {
    let path = Path::new("/proc/self/mountinfo");
    let text = std::fs::read_to_string(path).map_err(|source| UninstallError::Io {
        what: "read",
        path: path.to_path_buf(),
        source,
    })?;
    let roots = [config.state_dir.as_path(), config.root_dir.as_path()];
    let mut failed = None;
    for target in mounts_under(&text, &roots) {
        match output("umount", &["--lazy", &target.to_string_lossy()]) {
            Ok(_) => removed.push(format!("mount {}", target.display())),
            Err(e) => failed = Some(e),
        }
    }
    failed.map_or(Ok(()), Err)
}

/// Mount points in `mountinfo` at or under one of `roots`, deepest first.
fn mounts_under(mountinfo: &str, roots: &[&Path]) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = mountinfo
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| PathBuf::from(unescape_mountinfo(p)))
        .filter(|p| roots.iter().any(|r| p.starts_with(r)))
        .collect();
    // Deepest first; equal depths by name, so duplicates (a path mounted
    // over twice) sit together and go once.
    found.sort_by(|a, b| {
        b.components()
            .count()
            .cmp(&a.components().count())
            .then_with(|| a.cmp(b))
    });
    found.dedup();
    found
}

/// Undoes mountinfo's octal escapes (`\040` for a space, …).
fn unescape_mountinfo(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if let Some(&[b'\\', a, b, c]) = bytes.get(i..i + 4) {
            if [a, b, c].iter().all(|d| (b'0'..=b'7').contains(d)) {
                let value =
                    u32::from(a - b'0') * 64 + u32::from(b - b'0') * 8 + u32::from(c - b'0');
                if let Ok(byte) = u8::try_from(value) {
                    out.push(byte);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Detaches loop devices whose backing file is under the root directory
/// (the scratch pool's).
fn loop_devices(config: &Config, removed: &mut Vec<String>) -> Result<(), UninstallError> {
    let listing = match output("losetup", &["--noheadings", "--output", "NAME,BACK-FILE"]) {
        Ok(l) => l,
        // No loop support or no losetup: there is nothing of ours to detach.
        Err(_) => return Ok(()),
    };
    let mut failed = None;
    for line in listing.lines() {
        let mut fields = line.split_whitespace();
        let (Some(device), Some(file)) = (fields.next(), fields.next()) else {
            continue;
        };
        if Path::new(file).starts_with(&config.root_dir) {
            match output("losetup", &["--detach", device]) {
                Ok(_) => removed.push(format!("loop device {device} ({file})")),
                Err(e) => failed = Some(e),
            }
        }
    }
    failed.map_or(Ok(()), Err)
}

/// The bridge provider's veths, bridge and nft table.
fn network(config: &Config, removed: &mut Vec<String>) -> Result<(), UninstallError> {
    if config.network.provider != NetworkProvider::Bridge {
        return Ok(());
    }
    let bridge = config.network.bridge.name.as_str();
    let exists = |link: &str| output("ip", &["link", "show", "dev", link]).is_ok();
    if exists(bridge) {
        // Veths whose pod netns pin was unmounted are gone with the
        // namespace; any still enslaved to the bridge go now.
        let ports = output("ip", &["-o", "link", "show", "master", bridge]).unwrap_or_default();
        for name in ports.lines().filter_map(link_name) {
            if name.starts_with(cubelet_network::VETH_PREFIX) {
                output("ip", &["link", "delete", "dev", &name])?;
                removed.push(format!("veth {name}"));
            }
        }
        output("ip", &["link", "delete", "dev", bridge])?;
        removed.push(format!("bridge {bridge}"));
    }
    let table = cubelet_network::nft_table_name(bridge);
    if output("nft", &["list", "table", "ip", &table]).is_ok() {
        output("nft", &["delete", "table", "ip", &table])?;
        removed.push(format!("nft table ip {table}"));
    }
    Ok(())
}

/// The link name of an `ip -o link` line (`3: cb12@if2: <…>`).
fn link_name(line: &str) -> Option<String> {
    let name = line.split(": ").nth(1)?;
    Some(name.split('@').next().unwrap_or(name).to_string())
}

/// The CRI socket, when it lives outside the state directory.
fn socket(config: &Config, removed: &mut Vec<String>) -> Result<(), UninstallError> {
    remove_file(&config.socket, removed)
}

fn remove_file(path: &Path, removed: &mut Vec<String>) -> Result<(), UninstallError> {
    match std::fs::remove_file(path) {
        Ok(()) => {
            removed.push(format!("file {}", path.display()));
            Ok(())
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(UninstallError::Io {
            what: "remove",
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// The state and root directories.
fn directories(config: &Config, removed: &mut Vec<String>) -> Result<(), UninstallError> {
    for dir in [&config.state_dir, &config.root_dir] {
        if !is_dedicated(dir) {
            return Err(UninstallError::UnsafePath(dir.clone()));
        }
        match std::fs::remove_dir_all(dir) {
            Ok(()) => removed.push(format!("directory {}", dir.display())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(UninstallError::Io {
                    what: "remove",
                    path: dir.clone(),
                    source,
                })
            }
        }
    }
    Ok(())
}

/// True for an absolute directory at least two levels deep that is not a
/// well-known system directory: one Cubelet may own whole.
fn is_dedicated(dir: &Path) -> bool {
    const SYSTEM: &[&str] = &[
        "/etc",
        "/usr",
        "/var/lib",
        "/var/run",
        "/run/user",
        "/home",
        "/root",
        "/opt",
        "/srv",
    ];
    dir.is_absolute()
        && dir.components().count() >= 3
        && !SYSTEM.iter().any(|s| dir == Path::new(s))
        && !dir
            .components()
            .any(|c| matches!(c, std::path::Component::ParentDir))
}

/// Loads `file` (and its drop-ins) like the agent does, or the defaults when
/// the file does not exist (a package already removed its configuration).
pub fn load_config(file: &Path, dir: Option<&Path>) -> Result<Config, crate::config::ConfigError> {
    if file.exists() || dir.is_some_and(Path::exists) {
        Config::load(file, dir)
    } else {
        Ok(Config::default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mounts_under_the_roots_deepest_first() {
        let info = "\
22 1 8:1 / / rw - ext4 /dev/sda1 rw
30 22 0:4 net:[1] /run/cubelet/netns/abc rw - nsfs nsfs rw
31 22 0:40 / /var/lib/cubelet/sandboxes/abc/shm rw - tmpfs shm rw
32 22 0:41 / /var/lib/cubelet rw - tmpfs t rw
33 22 0:42 / /var/lib/cubelet-other rw - tmpfs t rw
34 22 0:43 / /run/cubelet/with\\040space rw - tmpfs t rw
";
        let found = mounts_under(
            info,
            &[Path::new("/run/cubelet"), Path::new("/var/lib/cubelet")],
        );
        assert_eq!(
            found,
            vec![
                PathBuf::from("/var/lib/cubelet/sandboxes/abc/shm"),
                PathBuf::from("/run/cubelet/netns/abc"),
                PathBuf::from("/run/cubelet/with space"),
                PathBuf::from("/var/lib/cubelet"),
            ]
        );
    }

    #[test]
    fn only_dedicated_directories_are_removed() {
        for ok in ["/var/lib/cubelet", "/run/cubelet", "/srv/x/cubelet"] {
            assert!(is_dedicated(Path::new(ok)), "{ok}");
        }
        for bad in [
            "/",
            "/run",
            "/var",
            "/var/lib",
            "/etc",
            "run/cubelet",
            "/var/lib/../etc",
        ] {
            assert!(!is_dedicated(Path::new(bad)), "{bad}");
        }
    }

    #[test]
    fn link_names_and_snapshot_keys_parse() {
        assert_eq!(
            link_name("7: cb0123@if2: <BROADCAST> mtu 1500 master cubelet0").as_deref(),
            Some("cb0123")
        );
        assert_eq!(link_name("garbage"), None);
        assert_eq!(
            snapshot_keys("KEY PARENT KIND\nsha256:a  Committed\nk1 sha256:a Active\n"),
            vec!["sha256:a".to_string(), "k1".to_string()]
        );
    }

    #[test]
    fn a_missing_config_means_the_defaults() {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = load_config(&dir.path().join("absent.yaml"), None).expect("defaults");
        assert_eq!(config, Config::default());
    }
}
