//! The mount table as `/proc/<pid>/mountinfo` gives it, parsed in one
//! place for every crate that reads it (the storage provider's mounts and
//! GC, the runtime's staged mounts and cgroup layout).
//!
//! The `procfs` crate parses mountinfo too, but leaves the kernel's octal
//! escapes (`\040` for a space) in mount points and spreads the options
//! into maps; the callers here want the path as the file system spells it
//! and the option text as the kernel wrote it.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// One line of the mount table, the fields this crate uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    /// Where it is mounted (octal escapes decoded).
    pub mount_point: PathBuf,
    /// Per-mount options (`rw,nosuid,nodev,noexec,relatime`, ...).
    pub mount_options: String,
    /// Filesystem type (`tmpfs`, `ext4`, ...).
    pub fstype: String,
    /// Mount source (`shm`, `/dev/loop3`, ...).
    pub source: String,
    /// Per-superblock options (`size=65536k,mode=1777`, ...).
    pub super_options: String,
}

/// Decodes the `\ooo` octal escapes the kernel uses for space, tab, newline
/// and backslash in mountinfo paths.
pub fn unescape(field: &str) -> PathBuf {
    use std::os::unix::ffi::OsStringExt;
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 3 < bytes.len() {
            let oct = &bytes[i + 1..i + 4];
            if oct.iter().all(|b| (b'0'..=b'7').contains(b)) {
                let v = oct
                    .iter()
                    .fold(0u32, |acc, b| acc * 8 + u32::from(b - b'0'));
                if let Ok(b) = u8::try_from(v) {
                    out.push(b);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    PathBuf::from(std::ffi::OsString::from_vec(out))
}

/// Parses the text of a `mountinfo` file; malformed lines are skipped.
pub fn parse(text: &str) -> Vec<MountEntry> {
    text.lines()
        .filter_map(|line| {
            // id parent major:minor root mount_point options [optional...] - fstype source super_options
            let (pre, post) = line.split_once(" - ")?;
            let mut pre = pre.split(' ').skip(4);
            let mount_point = pre.next()?;
            let mount_options = pre.next()?;
            let mut post = post.split(' ');
            let fstype = post.next()?;
            let source = post.next()?;
            let super_options = post.next().unwrap_or("");
            Some(MountEntry {
                mount_point: unescape(mount_point),
                mount_options: mount_options.to_owned(),
                fstype: fstype.to_owned(),
                source: source.to_owned(),
                super_options: super_options.to_owned(),
            })
        })
        .collect()
}

/// The calling thread's mount table (`/proc/thread-self/mountinfo`, else
/// the process's).
pub fn own() -> io::Result<Vec<MountEntry>> {
    let text = match fs::read_to_string(Path::new("/proc/thread-self/mountinfo")) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            fs::read_to_string(Path::new("/proc/self/mountinfo"))?
        }
        Err(e) => return Err(e),
    };
    Ok(parse(&text))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
22 27 0:21 / /proc rw,relatime - proc proc rw
25 24 0:23 / /dev/shm rw,relatime shared:3 - tmpfs tmpfs rw,size=24683656k
99 27 0:50 / /var/lib/cubelet/sandboxes/abc/shm rw,nosuid,nodev,noexec,relatime - tmpfs shm rw,size=65536k,mode=1777
100 27 7:3 / /tmp/with\\040space/scratch rw,relatime - ext4 /dev/loop3 rw
36 35 98:0 /mnt1 /mnt/with\\040space rw,nosuid,noatime master:1 - ext3 /dev/root rw
bogus line
";

    #[test]
    fn parses_mountinfo() {
        let t = parse(SAMPLE);
        assert_eq!(t.len(), 5);
        assert_eq!(t[1].mount_point, Path::new("/dev/shm"));
        assert_eq!(t[2].fstype, "tmpfs");
        assert_eq!(t[2].source, "shm");
        assert_eq!(t[2].mount_options, "rw,nosuid,nodev,noexec,relatime");
        assert!(t[2].super_options.contains("size=65536k"));
        assert_eq!(t[3].mount_point, Path::new("/tmp/with space/scratch"));
        assert_eq!(t[3].source, "/dev/loop3");
        // Optional fields (`master:1`) are skipped.
        assert_eq!(t[4].mount_point, Path::new("/mnt/with space"));
        assert_eq!(t[4].mount_options, "rw,nosuid,noatime");
        assert_eq!(t[4].fstype, "ext3");
    }

    #[test]
    fn unescape_leaves_plain_backslashes() {
        assert_eq!(unescape("a\\b"), Path::new("a\\b"));
        assert_eq!(unescape("a\\134b"), Path::new("a\\b"));
        assert_eq!(unescape("x\\04"), Path::new("x\\04"));
    }

    #[test]
    fn own_mount_table_has_root() {
        let t = own().unwrap();
        assert!(t.iter().any(|m| m.mount_point == Path::new("/")));
    }
}
