//! Resource usage of containers and pods: cgroup v1 and v2 readers, the CPU
//! rate between two samples, `/proc/<pid>/net/dev`, and the writable layer
//! usage of a container's snapshot.
//!
//! The readers are pure functions over a root directory, so they work on the
//! real `/sys/fs/cgroup` and on fixture trees alike. [`CgroupLayout::detect`]
//! finds where the controllers are mounted; on a hybrid host (v1 controllers
//! plus a v2 mount at `unified`) the v1 controllers are used.
//!
//! Writable-layer usage is not asked of the snapshotter per stats call (that
//! is a containerd round trip, and for overlayfs a walk of the upper
//! directory, per container): as containerd's CRI does with its snapshot
//! syncer, the usage of each container is read once when first asked for,
//! kept, and re-read in the background every [`SNAPSHOT_USAGE_PERIOD`]
//! ([`ContainerRuntime::refresh_snapshot_usage_every`]). Cgroup readings stay
//! live.

pub mod cgroups;
pub(crate) mod collect;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use containerd_client::services::v1::snapshots::UsageRequest;

use crate::container::ContainerRuntime;
use crate::error::RuntimeError;
use crate::stats::cgroups::cgroup_mounts;

/// Memory usage of one cgroup.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Total usage (`memory.usage_in_bytes` / `memory.current`).
    pub usage_bytes: u64,
    /// Usage minus inactive file pages.
    pub working_set_bytes: u64,
    /// Anonymous memory (`rss` / `anon`).
    pub rss_bytes: u64,
    /// Page faults.
    pub page_faults: u64,
    /// Major page faults.
    pub major_page_faults: u64,
    /// The limit, `None` when unlimited.
    pub limit_bytes: Option<u64>,
}

impl MemoryStats {
    /// Bytes left before the limit (`limit - working set`), when limited.
    pub fn available_bytes(&self) -> Option<u64> {
        self.limit_bytes
            .map(|l| l.saturating_sub(self.working_set_bytes))
    }
}

/// Block I/O of one cgroup, summed over its devices (cgroup v2 `io.stat`:
/// `<major>:<minor> rbytes=.. wbytes=.. rios=.. wios=.. dbytes=.. dios=..`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IoStats {
    /// Bytes read (`rbytes`).
    pub read_bytes: u64,
    /// Bytes written (`wbytes`).
    pub write_bytes: u64,
    /// Read operations (`rios`).
    pub read_ops: u64,
    /// Write operations (`wios`).
    pub write_ops: u64,
}

/// One line of a pressure stall information file: the share of wall time
/// (in percent) some or all tasks were stalled, averaged over 10 s, 60 s
/// and 300 s, and the total stall time.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PsiData {
    /// `avg10`, percent.
    pub avg10: f64,
    /// `avg60`, percent.
    pub avg60: f64,
    /// `avg300`, percent.
    pub avg300: f64,
    /// `total`: cumulative stall time in microseconds.
    pub total_us: u64,
}

/// A pressure stall information file (`cpu.pressure`, `memory.pressure`,
/// `io.pressure` of a cgroup v2 directory, kernel 4.20+ with PSI on).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Pressure {
    /// `some`: at least one task stalled.
    pub some: PsiData,
    /// `full`: every non-idle task stalled at once (`None` where the kernel
    /// does not report it, as for `cpu.pressure` before 5.13).
    pub full: Option<PsiData>,
}

/// The pressure stall information of one cgroup, each resource `None`
/// when its file is missing (cgroup v1, or PSI off). Kubernetes 1.36's CRI
/// carries these as `PsiStats` of `CpuUsage`, `MemoryUsage` and `IoUsage`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PsiStats {
    /// `cpu.pressure`.
    pub cpu: Option<Pressure>,
    /// `memory.pressure`.
    pub memory: Option<Pressure>,
    /// `io.pressure`.
    pub io: Option<Pressure>,
}

impl PsiStats {
    /// True when no pressure file was read.
    pub fn is_empty(&self) -> bool {
        self.cpu.is_none() && self.memory.is_none() && self.io.is_none()
    }
}

/// What one cgroup reports; each part is `None` when its controller is
/// missing or unreadable.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CgroupStats {
    /// Cumulative CPU time in nanoseconds.
    pub cpu_usage_ns: Option<u64>,
    /// Memory.
    pub memory: Option<MemoryStats>,
    /// Number of processes (`pids.current`, else `cgroup.procs` lines).
    pub processes: Option<u64>,
    /// Block I/O (cgroup v2 `io.stat`; `None` on v1 or without the `io`
    /// controller).
    pub io: Option<IoStats>,
    /// Pressure stall information (cgroup v2 only; see [`PsiStats`]).
    pub psi: PsiStats,
}

impl CgroupStats {
    /// Adds `other` into `self` (pod totals from container cgroups); the
    /// memory limit and the pressure of a sum are unknown.
    pub fn accumulate(&mut self, other: &CgroupStats) {
        fn add(a: &mut Option<u64>, b: Option<u64>) {
            if let Some(b) = b {
                *a = Some(a.unwrap_or(0).saturating_add(b));
            }
        }
        add(&mut self.cpu_usage_ns, other.cpu_usage_ns);
        add(&mut self.processes, other.processes);
        if let Some(o) = other.io {
            let io = self.io.get_or_insert_with(IoStats::default);
            io.read_bytes = io.read_bytes.saturating_add(o.read_bytes);
            io.write_bytes = io.write_bytes.saturating_add(o.write_bytes);
            io.read_ops = io.read_ops.saturating_add(o.read_ops);
            io.write_ops = io.write_ops.saturating_add(o.write_ops);
        }
        // Stall shares of several cgroups do not add up: a sum has none.
        self.psi = PsiStats::default();
        if let Some(o) = other.memory {
            let m = self.memory.get_or_insert_with(MemoryStats::default);
            m.usage_bytes = m.usage_bytes.saturating_add(o.usage_bytes);
            m.working_set_bytes = m.working_set_bytes.saturating_add(o.working_set_bytes);
            m.rss_bytes = m.rss_bytes.saturating_add(o.rss_bytes);
            m.page_faults = m.page_faults.saturating_add(o.page_faults);
            m.major_page_faults = m.major_page_faults.saturating_add(o.major_page_faults);
            m.limit_bytes = None;
        }
    }

    /// True if no controller reported anything (the cgroup does not exist).
    pub fn is_empty(&self) -> bool {
        self.cpu_usage_ns.is_none()
            && self.memory.is_none()
            && self.processes.is_none()
            && self.io.is_none()
            && self.psi.is_empty()
    }
}

/// Where the cgroup controllers are mounted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CgroupLayout {
    /// cgroups v1 (or hybrid): one mount per controller.
    V1 {
        /// Mount of the `memory` controller.
        memory: Option<PathBuf>,
        /// Mount of the `cpuacct` controller (may be shared with `cpu`).
        cpuacct: Option<PathBuf>,
        /// Mount of the `pids` controller.
        pids: Option<PathBuf>,
    },
    /// The unified hierarchy.
    V2 {
        /// Its mount point.
        root: PathBuf,
    },
}

/// Limits at or above this are "unlimited" (v1 reports `PAGE_COUNTER_MAX`
/// rounded to the page size).
const UNLIMITED: u64 = 1 << 62;

impl CgroupLayout {
    /// Reads `/proc/self/mountinfo` and picks the layout.
    pub fn detect() -> Result<Self, RuntimeError> {
        let path = "/proc/self/mountinfo";
        let text = std::fs::read_to_string(path).map_err(|source| RuntimeError::Io {
            op: "read",
            path: path.to_owned(),
            source,
        })?;
        Ok(Self::from_mountinfo(&text))
    }

    /// The layout described by a mountinfo text: v1 if any v1 controller we
    /// read is mounted, otherwise the cgroup2 mount (default `/sys/fs/cgroup`).
    pub fn from_mountinfo(text: &str) -> Self {
        let mut memory = None;
        let mut cpuacct = None;
        let mut pids = None;
        let mut unified = None;
        for m in cgroup_mounts(text) {
            if m.v2 {
                unified = unified.or(Some(m.mount_point));
                continue;
            }
            for c in &m.controllers {
                let slot = match c.as_str() {
                    "memory" => &mut memory,
                    "cpuacct" => &mut cpuacct,
                    "pids" => &mut pids,
                    _ => continue,
                };
                if slot.is_none() {
                    *slot = Some(m.mount_point.clone());
                }
            }
        }
        if memory.is_some() || cpuacct.is_some() || pids.is_some() {
            CgroupLayout::V1 {
                memory,
                cpuacct,
                pids,
            }
        } else {
            CgroupLayout::V2 {
                root: unified.unwrap_or_else(|| PathBuf::from("/sys/fs/cgroup")),
            }
        }
    }

    /// Reads the cgroup at `path` (as in the OCI spec, e.g. `/cubelet/<id>`).
    /// A cgroup that does not exist yields [`CgroupStats::is_empty`].
    pub fn read(&self, path: &str) -> CgroupStats {
        self.read_parts(path, true, None)
    }

    /// [`CgroupLayout::read`] without the process count (`processes` is
    /// `None`): CRI's container stats carry none, and each file read is a
    /// few microseconds, times every container on the node.
    pub fn read_usage(&self, path: &str) -> CgroupStats {
        self.read_parts(path, false, None)
    }

    /// [`CgroupLayout::read`] (with the process count if `processes`),
    /// through the files `files` keeps open.
    pub fn read_with(&self, path: &str, processes: bool, files: &OpenFiles) -> CgroupStats {
        self.read_parts(path, processes, Some(files))
    }

    /// How many processes of the cgroup at `path` the kernel's OOM killer
    /// has killed (`oom_kill` of v1 `memory.oom_control`, v2
    /// `memory.events`); `None` when the cgroup or the counter is missing.
    pub fn oom_kills(&self, path: &str) -> Option<u64> {
        let rel = path.trim_start_matches('/');
        let (dir, file) = match self {
            CgroupLayout::V1 { memory, .. } => (memory.as_ref()?.join(rel), "memory.oom_control"),
            CgroupLayout::V2 { root } => (root.join(rel), "memory.events"),
        };
        flat_get(&CgroupDir::at(&dir).read(file)?, "oom_kill")
    }

    /// The node's layout, detected once ([`CgroupLayout::detect`]; v2 at
    /// `/sys/fs/cgroup` if the mount table cannot be read).
    pub fn node() -> &'static CgroupLayout {
        static NODE: std::sync::OnceLock<CgroupLayout> = std::sync::OnceLock::new();
        NODE.get_or_init(|| {
            CgroupLayout::detect().unwrap_or_else(|e| {
                tracing::warn!(error = %e, "cgroup layout unknown; assuming v2 at /sys/fs/cgroup");
                CgroupLayout::V2 {
                    root: "/sys/fs/cgroup".into(),
                }
            })
        })
    }

    fn read_parts<'a>(
        &'a self,
        path: &'a str,
        processes: bool,
        files: Option<&'a OpenFiles>,
    ) -> CgroupStats {
        let rel = path.trim_start_matches('/');
        // One look-up of the cgroup's open files for all its controllers.
        let open = files.map(|f| (f, f.of(rel)));
        let open = open.as_ref().map(|(f, o)| (*f, rel, o));
        match self {
            CgroupLayout::V1 {
                memory,
                cpuacct,
                pids,
            } => {
                let dir = |root: &'a Option<PathBuf>| {
                    root.as_deref().map(|root| CgroupDir::new(root, rel, open))
                };
                CgroupStats {
                    cpu_usage_ns: dir(cpuacct).and_then(|d| d.read_u64("cpuacct.usage")),
                    memory: dir(memory).and_then(|d| v1_memory(&d)),
                    processes: dir(pids)
                        .filter(|_| processes)
                        .and_then(|d| processes_in(&d)),
                    // v1's blkio counts are not read, and v1 has no PSI.
                    io: None,
                    psi: PsiStats::default(),
                }
            }
            CgroupLayout::V2 { root } => read_v2_parts(&CgroupDir::new(root, rel, open), processes),
        }
    }
}

/// The open files of one cgroup that a reading may use: the cgroup's
/// [`OpenFiles`], its path (relative to each controller's mount) and the
/// files themselves.
type OpenHere<'a> = (&'a OpenFiles, &'a str, &'a std::sync::Arc<CgroupFiles>);

/// A cgroup directory whose files are opened relative to it, so the path
/// from `/` is walked once per cgroup rather than once per file (at a few
/// hundred containers, path walks were most of a List*Stats call), or not
/// at all when [`OpenFiles`] has them open already (then the directory's
/// path is not even built).
struct CgroupDir<'a> {
    /// The controller's mount (or, with `rel` empty, the directory).
    root: &'a Path,
    /// The cgroup's path below `root`.
    rel: &'a str,
    fd: std::cell::OnceCell<Option<std::fs::File>>,
    open: Option<OpenHere<'a>>,
}

impl<'a> CgroupDir<'a> {
    fn new(root: &'a Path, rel: &'a str, open: Option<OpenHere<'a>>) -> CgroupDir<'a> {
        CgroupDir {
            root,
            rel,
            fd: std::cell::OnceCell::new(),
            open,
        }
    }

    /// The directory `dir` itself, its files opened and read each time.
    fn at(dir: &'a Path) -> CgroupDir<'a> {
        CgroupDir::new(dir, "", None)
    }

    /// File `name`, opened relative to the directory (opened on first use).
    fn open(&self, name: &str) -> Option<std::fs::File> {
        use rustix::fs::{open, openat, Mode, OFlags};
        let dir = self
            .fd
            .get_or_init(|| {
                let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
                let opened = match self.rel {
                    "" => open(self.root, flags, Mode::empty()),
                    rel => open(self.root.join(rel), flags, Mode::empty()),
                };
                opened.ok().map(std::fs::File::from)
            })
            .as_ref()?;
        let fd = openat(dir, name, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty()).ok()?;
        Some(fd.into())
    }

    /// `parse` of the text of file `name`, read into this thread's buffer
    /// (a List*Stats call reads a few files for every container, on
    /// threads that share one malloc arena: nothing is allocated for one).
    fn parse<R>(&self, name: &'static str, parse: impl FnOnce(&str) -> Option<R>) -> Option<R> {
        let kept = self
            .open
            .and_then(|(all, rel, here)| Some((all, rel, here.slot(name)?)));
        let Some((all, rel, slot)) = kept else {
            return parse_from_start(&self.open(name)?, one_record(name), parse);
        };
        // A file that cannot be opened is not kept: the next call tries
        // again (it may be a controller's file that is not there).
        let file = match slot.get() {
            Some(file) => file,
            None => {
                let opened = self.open(name)?;
                slot.get_or_init(|| opened)
            }
        };
        let mut readable = false;
        let out = parse_from_start(file, one_record(name), |text| {
            readable = true;
            parse(text)
        });
        if !readable && !may_fail_to_read(name) {
            // The cgroup is gone: its files are closed once the readings
            // holding them are done.
            all.forget(rel);
        }
        out
    }

    fn read(&self, name: &'static str) -> Option<String> {
        self.parse(name, |text| Some(text.to_owned()))
    }

    fn read_u64(&self, name: &'static str) -> Option<u64> {
        self.parse(name, |text| text.trim().parse().ok())
    }
}

/// `parse` of the whole text of `file` from offset 0, read by `pread` (a
/// cgroup file, a seq_file, generates its text afresh for a read at offset
/// 0) into a buffer this thread keeps; `None` if it cannot be read or is
/// not UTF-8.
///
/// With `one_record`, a read that leaves room in the buffer is the whole
/// file and no read at the end confirms it: a cgroup file other than
/// `cgroup.procs` is one seq_file record, which the kernel generates whole
/// (growing its own buffer as needed) and copies out as far as the reader's
/// buffer goes. That halves the system calls of a List*Stats call. A file of
/// many records (`cgroup.procs`) may stop short of its end where the kernel's
/// buffer filled, so it is read until a read returns nothing.
fn parse_from_start<R>(
    file: &std::fs::File,
    one_record: bool,
    parse: impl FnOnce(&str) -> Option<R>,
) -> Option<R> {
    use std::os::unix::fs::FileExt;
    thread_local! {
        static BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    BUF.with(|buf| {
        // A parse never reads a file, so the buffer is never borrowed twice;
        // should it be, a buffer of its own does.
        let mut own = Vec::new();
        let mut cell = buf.try_borrow_mut();
        let buf = match cell.as_deref_mut() {
            Ok(b) => b,
            Err(_) => &mut own,
        };
        if buf.len() < 4096 {
            buf.resize(4096, 0);
        }
        let mut n = 0;
        loop {
            if n == buf.len() {
                buf.resize(n * 2, 0);
            }
            let room = buf.len() - n;
            let read = file.read_at(&mut buf[n..], u64::try_from(n).ok()?).ok()?;
            n += read;
            if read == 0 || (one_record && read < room) {
                break;
            }
        }
        parse(std::str::from_utf8(&buf[..n]).ok()?)
    })
}

/// Whether cgroup file `name` may be there and still fail to read while
/// its cgroup lives: the pressure files of a kernel with PSI off
/// (`EOPNOTSUPP`). Such a failure does not close the cgroup's files.
fn may_fail_to_read(name: &str) -> bool {
    name.ends_with(".pressure")
}

/// Whether cgroup file `name` is one seq_file record (see
/// [`parse_from_start`]): every file read here but `cgroup.procs`.
fn one_record(name: &str) -> bool {
    name != "cgroup.procs"
}

/// The cgroup files [`OpenFiles`] keeps open, v1 and v2 (a name is in one
/// controller's directory only, so one cgroup's files of every controller
/// share a slot table).
const KEPT_FILES: [&str; 13] = [
    "cpuacct.usage",
    "cpu.stat",
    "memory.usage_in_bytes",
    "memory.current",
    "memory.stat",
    "memory.limit_in_bytes",
    "memory.max",
    "pids.current",
    "cgroup.procs",
    "io.stat",
    "cpu.pressure",
    "memory.pressure",
    "io.pressure",
];

/// The files of one cgroup that [`OpenFiles`] keeps, a slot per name of
/// [`KEPT_FILES`], each empty until the file is first opened.
#[derive(Debug, Default)]
struct CgroupFiles {
    slots: [std::sync::OnceLock<std::fs::File>; KEPT_FILES.len()],
}

impl CgroupFiles {
    fn slot(&self, name: &str) -> Option<&std::sync::OnceLock<std::fs::File>> {
        let i = KEPT_FILES.iter().position(|f| *f == name)?;
        self.slots.get(i)
    }

    fn open(&self) -> usize {
        self.slots.iter().filter(|s| s.get().is_some()).count()
    }
}

/// Cgroup files kept open from one List*Stats call to the next, so that a
/// reading is one `pread` per file: opening a cgroup file (a path walk, the
/// kernfs open, the seq_file set-up) costs more than reading it. Keyed by
/// the cgroup's path (below the controllers' mounts), looked up once per
/// reading for all of its files; [`OpenFiles::retain`] closes the files
/// of cgroups no longer wanted, and a file that cannot be opened or read
/// (its cgroup is gone) closes the files of its cgroup.
#[derive(Debug, Default)]
pub struct OpenFiles {
    cgroups: Mutex<HashMap<String, std::sync::Arc<CgroupFiles>>>,
}

impl OpenFiles {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, std::sync::Arc<CgroupFiles>>> {
        // Every update is one insert or remove: a poisoned map is intact.
        self.cgroups.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The files of the cgroup at `rel`, an empty table the first time.
    fn of(&self, rel: &str) -> std::sync::Arc<CgroupFiles> {
        let mut cgroups = self.lock();
        match cgroups.get(rel) {
            Some(files) => std::sync::Arc::clone(files),
            None => std::sync::Arc::clone(cgroups.entry(rel.to_owned()).or_default()),
        }
    }

    /// Closes the files of the cgroup at `rel` (once the readings holding
    /// them are done).
    fn forget(&self, rel: &str) {
        self.lock().remove(rel);
    }

    /// Closes the files of every cgroup whose container id `keep` refuses
    /// (the id its directory name carries under either cgroup driver:
    /// `<id>` or `cubelet-<id>.scope`).
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        self.lock().retain(|rel, _| {
            keep(crate::cgroup::container_id_of_dir(
                rel.rsplit('/').next().unwrap_or(rel),
            ))
        });
    }

    /// How many files are open.
    pub fn len(&self) -> usize {
        self.lock().values().map(|f| f.open()).sum()
    }

    /// True when no file is open.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A key of a flat-keyed cgroup file (`key value` lines: `memory.stat`,
/// `cpu.stat`, `memory.events`), with the searcher for its line made once.
/// At a few hundred containers a List*Stats call reads a `memory.stat` of
/// some 40 lines for each: splitting every line at its space was a tenth
/// of the call, where a search for the four wanted lines is a few hundred
/// nanoseconds.
struct FlatKey {
    /// `"<key> "`: the key's line at the start of the text.
    first: Vec<u8>,
    /// `"\n<key> "`: the key's line anywhere else.
    later: memchr::memmem::Finder<'static>,
}

impl FlatKey {
    fn new(key: &str) -> FlatKey {
        FlatKey {
            first: format!("{key} ").into_bytes(),
            later: memchr::memmem::Finder::new(format!("\n{key} ").as_bytes()).into_owned(),
        }
    }

    /// The key's value in `text`: `None` if it has no line or its value is
    /// no number.
    fn value(&self, text: &str) -> Option<u64> {
        let text = text.as_bytes();
        let at = match text.starts_with(&self.first) {
            true => self.first.len(),
            false => self.later.find(text)? + self.later.needle().len(),
        };
        let rest = text.get(at..)?;
        let end = memchr::memchr(b'\n', rest).unwrap_or(rest.len());
        parse_digits(&rest[..end])
    }
}

/// [`FlatKey`]s made once, for the files every List*Stats call reads.
struct Keys<const N: usize>(std::sync::LazyLock<[FlatKey; N]>);

impl<const N: usize> Keys<N> {
    /// The values of the keys in `text`, in order.
    fn values(&self, text: &str) -> [Option<u64>; N] {
        std::array::from_fn(|i| self.0[i].value(text))
    }
}

/// What a v1 `memory.stat` gives from its hierarchical counters:
/// `inactive_file`, `rss`, `pgfault`, `pgmajfault`.
static V1_MEMORY_TOTALS: Keys<4> = Keys(std::sync::LazyLock::new(|| {
    [
        "total_inactive_file",
        "total_rss",
        "total_pgfault",
        "total_pgmajfault",
    ]
    .map(FlatKey::new)
}));
/// The same of the cgroup's own counters, where a total is missing.
static V1_MEMORY_OWN: Keys<4> = Keys(std::sync::LazyLock::new(|| {
    ["inactive_file", "rss", "pgfault", "pgmajfault"].map(FlatKey::new)
}));
/// What a v2 `memory.stat` gives (its counters are hierarchical).
static V2_MEMORY: Keys<4> = Keys(std::sync::LazyLock::new(|| {
    ["inactive_file", "anon", "pgfault", "pgmajfault"].map(FlatKey::new)
}));
/// The CPU time of a v2 `cpu.stat`.
static V2_CPU: Keys<1> = Keys(std::sync::LazyLock::new(|| [FlatKey::new("usage_usec")]));

/// A decimal number, optionally followed by white space.
fn parse_digits(text: &[u8]) -> Option<u64> {
    let digits = text.trim_ascii_end();
    if digits.is_empty() {
        return None;
    }
    digits.iter().try_fold(0u64, |n, d| {
        let d = d.checked_sub(b'0').filter(|d| *d < 10)?;
        n.checked_mul(10)?.checked_add(u64::from(d))
    })
}

/// The value of `key` in `key value` lines (`memory.oom_control`,
/// `memory.events`).
fn flat_get(text: &str, key: &str) -> Option<u64> {
    FlatKey::new(key).value(text)
}

/// cgroup v1 `cpuacct.usage` in `dir`: nanoseconds.
pub fn read_v1_cpu(dir: &Path) -> Option<u64> {
    CgroupDir::at(dir).read_u64("cpuacct.usage")
}

/// cgroup v1 memory controller files in `dir`. Uses the hierarchical
/// `total_*` counters of `memory.stat` when present.
pub fn read_v1_memory(dir: &Path) -> Option<MemoryStats> {
    v1_memory(&CgroupDir::at(dir))
}

fn v1_memory(dir: &CgroupDir<'_>) -> Option<MemoryStats> {
    let usage = dir.read_u64("memory.usage_in_bytes")?;
    let [inactive_file, rss, pgfault, pgmajfault] = dir
        .parse("memory.stat", |stat| Some(v1_stat_values(stat)))
        .unwrap_or_default();
    let limit = dir
        .read_u64("memory.limit_in_bytes")
        .filter(|l| *l < UNLIMITED);
    Some(MemoryStats {
        usage_bytes: usage,
        working_set_bytes: usage.saturating_sub(inactive_file),
        rss_bytes: rss,
        page_faults: pgfault,
        major_page_faults: pgmajfault,
        limit_bytes: limit,
    })
}

/// `inactive_file`, `rss`, `pgfault` and `pgmajfault` of a v1 `memory.stat`,
/// each from its hierarchical `total_` line when there is one.
fn v1_stat_values(stat: &str) -> [u64; 4] {
    let totals = V1_MEMORY_TOTALS.values(stat);
    std::array::from_fn(|i| {
        totals[i]
            .or_else(|| V1_MEMORY_OWN.0[i].value(stat))
            .unwrap_or(0)
    })
}

/// Process count: `pids.current`, else the lines of `cgroup.procs`.
pub fn read_processes(dir: &Path) -> Option<u64> {
    processes_in(&CgroupDir::at(dir))
}

fn processes_in(dir: &CgroupDir<'_>) -> Option<u64> {
    dir.read_u64("pids.current").or_else(|| {
        dir.parse("cgroup.procs", |procs| {
            u64::try_from(procs.lines().filter(|l| !l.trim().is_empty()).count()).ok()
        })
    })
}

/// A cgroup v2 directory: `cpu.stat` (`usage_usec`), `memory.current`,
/// `memory.stat` (working set = current − `inactive_file`, as kubelet's
/// cAdvisor), `memory.max`, `pids.current`, `io.stat` and the pressure
/// files (`cpu.pressure`, `memory.pressure`, `io.pressure`) when present.
pub fn read_v2(dir: &Path) -> CgroupStats {
    read_v2_parts(&CgroupDir::at(dir), true)
}

/// [`read_v2`], the process count only if `processes`.
fn read_v2_parts(dir: &CgroupDir<'_>, processes: bool) -> CgroupStats {
    let cpu = dir
        .parse("cpu.stat", |s| V2_CPU.values(s)[0])
        .map(|us| us.saturating_mul(1000));
    let memory = dir.read_u64("memory.current").map(|usage| {
        let [inactive_file, anon, pgfault, pgmajfault] = dir
            .parse("memory.stat", |stat| Some(V2_MEMORY.values(stat)))
            .unwrap_or_default();
        // "max" does not parse: unlimited.
        let limit = dir.read_u64("memory.max").filter(|l| *l < UNLIMITED);
        MemoryStats {
            usage_bytes: usage,
            working_set_bytes: usage.saturating_sub(inactive_file.unwrap_or(0)),
            rss_bytes: anon.unwrap_or(0),
            page_faults: pgfault.unwrap_or(0),
            major_page_faults: pgmajfault.unwrap_or(0),
            limit_bytes: limit,
        }
    });
    CgroupStats {
        cpu_usage_ns: cpu,
        memory,
        processes: processes.then(|| processes_in(dir)).flatten(),
        io: dir.parse("io.stat", parse_io_stat),
        psi: PsiStats {
            cpu: dir.parse("cpu.pressure", parse_pressure),
            memory: dir.parse("memory.pressure", parse_pressure),
            io: dir.parse("io.pressure", parse_pressure),
        },
    }
}

/// The totals of a v2 `io.stat` over its devices; `None` for a text with
/// no device line (the file is empty until the cgroup does I/O, which is
/// zero I/O, not a missing controller: so an empty file gives zeros).
pub fn parse_io_stat(text: &str) -> Option<IoStats> {
    let mut io = IoStats::default();
    for line in text.lines() {
        let mut fields = line.split_ascii_whitespace();
        if fields.next().is_none() {
            continue;
        }
        for kv in fields {
            let Some((k, v)) = kv.split_once('=') else {
                continue;
            };
            let Ok(v) = v.parse::<u64>() else {
                continue;
            };
            let slot = match k {
                "rbytes" => &mut io.read_bytes,
                "wbytes" => &mut io.write_bytes,
                "rios" => &mut io.read_ops,
                "wios" => &mut io.write_ops,
                _ => continue,
            };
            *slot = slot.saturating_add(v);
        }
    }
    Some(io)
}

/// A pressure stall information file: `some avg10=0.00 avg60=0.00
/// avg300=0.00 total=0` and, where the kernel reports it, a `full` line
/// of the same shape. `None` without a well-formed `some` line.
pub fn parse_pressure(text: &str) -> Option<Pressure> {
    let mut some = None;
    let mut full = None;
    for line in text.lines() {
        let mut fields = line.split_ascii_whitespace();
        let slot = match fields.next() {
            Some("some") => &mut some,
            Some("full") => &mut full,
            _ => continue,
        };
        let mut d = PsiData::default();
        let mut seen = 0;
        for kv in fields {
            let Some((k, v)) = kv.split_once('=') else {
                continue;
            };
            let ok = match k {
                "avg10" => v.parse().map(|x| d.avg10 = x).is_ok(),
                "avg60" => v.parse().map(|x| d.avg60 = x).is_ok(),
                "avg300" => v.parse().map(|x| d.avg300 = x).is_ok(),
                "total" => v.parse().map(|x| d.total_us = x).is_ok(),
                _ => false,
            };
            seen += usize::from(ok);
        }
        if seen == 4 {
            *slot = Some(d);
        }
    }
    Some(Pressure { some: some?, full })
}

/// A cumulative CPU time taken at a moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuSample {
    /// When, in nanoseconds since the Unix epoch.
    pub timestamp_ns: i64,
    /// Cumulative CPU time in nanoseconds.
    pub usage_ns: u64,
}

/// CPU use between two samples in nano-cores (1e9 = one core busy);
/// `None` if `cur` is not after `prev`. A counter that went back (the
/// cgroup was recreated) gives 0.
pub fn cpu_nano_cores(prev: &CpuSample, cur: &CpuSample) -> Option<u64> {
    let dt = cur.timestamp_ns.checked_sub(prev.timestamp_ns)?;
    let dt = u128::try_from(dt).ok().filter(|d| *d > 0)?;
    let used = u128::from(cur.usage_ns.saturating_sub(prev.usage_ns));
    u64::try_from(used * 1_000_000_000 / dt).ok()
}

/// Counters of one network interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InterfaceStats {
    /// Interface name.
    pub name: String,
    /// Received bytes.
    pub rx_bytes: u64,
    /// Receive errors.
    pub rx_errors: u64,
    /// Transmitted bytes.
    pub tx_bytes: u64,
    /// Transmit errors.
    pub tx_errors: u64,
}

/// Parses `/proc/net/dev`; the loopback interface is left out.
pub fn parse_net_dev(text: &str) -> Vec<InterfaceStats> {
    text.lines()
        .skip(2)
        .filter_map(|l| {
            let (name, rest) = l.split_once(':')?;
            let name = name.trim();
            if name == "lo" {
                return None;
            }
            let v: Vec<u64> = rest
                .split_whitespace()
                .map(|x| x.parse().unwrap_or(0))
                .collect();
            if v.len() < 11 {
                return None;
            }
            Some(InterfaceStats {
                name: name.to_owned(),
                rx_bytes: v[0],
                rx_errors: v[2],
                tx_bytes: v[8],
                tx_errors: v[10],
            })
        })
        .collect()
}

/// The interfaces of the network namespace `pid` lives in, from
/// `/proc/<pid>/net/dev` (no namespace switch needed).
pub fn read_net_dev(pid: u32) -> Result<Vec<InterfaceStats>, RuntimeError> {
    let path = format!("/proc/{pid}/net/dev");
    let text = std::fs::read_to_string(&path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            RuntimeError::NotFound {
                kind: "process",
                id: pid.to_string(),
            }
        } else {
            RuntimeError::Io {
                op: "read",
                path: path.clone(),
                source,
            }
        }
    })?;
    Ok(parse_net_dev(&text))
}

/// Disk use of a snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotUsage {
    /// Bytes used by the snapshot's own layer.
    pub bytes: u64,
    /// Inodes used.
    pub inodes: u64,
}

/// How often the background refresh re-reads the writable-layer usage it
/// holds (containerd's CRI `stats_collect_period` default).
pub const SNAPSHOT_USAGE_PERIOD: Duration = Duration::from_secs(10);

/// Writable-layer usage per container id, with when it was read.
#[derive(Debug, Default)]
pub struct SnapshotUsageCache {
    entries: Mutex<HashMap<String, (SnapshotUsage, SystemTime)>>,
}

impl SnapshotUsageCache {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (SnapshotUsage, SystemTime)>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The usage of `id` as last read, and when.
    pub fn get(&self, id: &str) -> Option<(SnapshotUsage, SystemTime)> {
        self.lock().get(id).copied()
    }

    /// Records a reading of `id`.
    pub fn put(&self, id: &str, usage: SnapshotUsage, at: SystemTime) {
        self.lock().insert(id.to_owned(), (usage, at));
    }

    /// Forgets `id`.
    pub fn forget(&self, id: &str) {
        self.lock().remove(id);
    }

    /// The ids held.
    pub fn ids(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }
}

impl ContainerRuntime {
    /// Usage of container `id`'s writable layer and when it was read: the
    /// background refresh's reading, or, for a container not read yet, a
    /// reading taken now (and kept).
    pub async fn writable_layer_usage(
        &self,
        id: &str,
    ) -> Result<(SnapshotUsage, SystemTime), RuntimeError> {
        if let Some(cached) = self.usage_cache().get(id) {
            return Ok(cached);
        }
        // Boxed: the round trip's state would otherwise be carried by the
        // future of every container a List*Stats call asks about, though
        // nearly all are answered from the kept readings.
        let usage = Box::pin(self.snapshot_usage(id)).await?;
        let now = SystemTime::now();
        self.usage_cache().put(id, usage, now);
        Ok((usage, now))
    }

    /// Re-reads the usage of every container held, one after another;
    /// forgets those whose snapshot is gone. How many were re-read.
    pub async fn refresh_snapshot_usage(&self) -> usize {
        let mut refreshed = 0;
        for id in self.usage_cache().ids() {
            refreshed += usize::from(self.refresh_usage_of(&id).await);
        }
        refreshed
    }

    /// Re-reads container `id`'s usage; whether it was read.
    async fn refresh_usage_of(&self, id: &str) -> bool {
        match self.snapshot_usage(id).await {
            Ok(usage) => {
                self.usage_cache().put(id, usage, SystemTime::now());
                true
            }
            Err(e) if e.is_not_found() => {
                self.usage_cache().forget(id);
                false
            }
            Err(e) => {
                tracing::debug!(container_id = %id, error = %e, "refreshing writable layer usage");
                false
            }
        }
    }

    /// Re-reads every held container's usage once every `period` until
    /// `shutdown`, the readings spread evenly over the period: each is a
    /// walk of the writable layer in containerd, and a burst of a few
    /// hundred made the stats calls that met it several times slower.
    pub async fn refresh_snapshot_usage_every(
        self: std::sync::Arc<Self>,
        period: Duration,
        shutdown: tokio_util::sync::CancellationToken,
    ) {
        loop {
            let ids = self.usage_cache().ids();
            let n = u32::try_from(ids.len()).unwrap_or(u32::MAX).max(1);
            let gap = period / n;
            if ids.is_empty() {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep(period) => {}
                }
            }
            for id in ids {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep(gap) => {}
                }
                self.refresh_usage_of(&id).await;
            }
        }
    }

    /// Usage of container `id`'s writable layer (its snapshot, keyed by the
    /// container id), asked of the snapshotter now.
    pub async fn snapshot_usage(&self, id: &str) -> Result<SnapshotUsage, RuntimeError> {
        let resp = self
            .client()
            .snapshots()
            .usage(self.client().request(UsageRequest {
                snapshotter: self.config().snapshotter.clone(),
                key: id.to_owned(),
            }))
            .await
            .map_err(|s| RuntimeError::containerd("snapshots.usage", s))?
            .into_inner();
        Ok(SnapshotUsage {
            bytes: u64::try_from(resp.size).unwrap_or(0),
            inodes: u64::try_from(resp.inodes).unwrap_or(0),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v1_stat_prefers_hierarchical_totals_and_falls_back_to_own_lines() {
        let stat = "rss 10\npgfault 3\ninactive_file 7\ntotal_rss 25\ntotal_inactive_file 9\nhierarchical_memory_limit 5\nbad line\n";
        // total_ wins where present; pgfault has only its own line; no
        // pgmajfault at all is 0.
        assert_eq!(v1_stat_values(stat), [9, 25, 3, 0]);
        assert_eq!(v1_stat_values(""), [0; 4]);
    }

    #[test]
    fn flat_keys_match_whole_keys_and_refuse_what_is_no_number() {
        let text = "rss_huge 5\nrss 7 \ntotal_rss_huge 1\npgfault x\npgmajfault \ninactive_file 99999999999999999999\nactive_file 4\n\n";
        let get = |key| flat_get(text, key);
        assert_eq!(get("rss"), Some(7));
        assert_eq!(get("rss_huge"), Some(5));
        assert_eq!(get("pgfault"), None);
        assert_eq!(get("pgmajfault"), None);
        assert_eq!(get("inactive_file"), None);
        assert_eq!(get("active_file"), Some(4));
        assert_eq!(get("huge"), None);
        // A `total_` line is a key of its own, and the last line needs no
        // newline.
        assert_eq!(flat_get("total_rss 3\n", "rss"), None);
        assert_eq!(flat_get("total_rss 3", "total_rss"), Some(3));
        assert_eq!(flat_get("usage_usec 12\nuser_usec 3", "user_usec"), Some(3));
        assert_eq!(V2_CPU.values("user_usec 1\nusage_usec 12\n"), [Some(12)]);
        assert_eq!(parse_digits(b"18446744073709551615"), Some(u64::MAX));
        assert_eq!(parse_digits(b"18446744073709551616"), None);
        assert_eq!(parse_digits(b"-1"), None);
    }

    #[test]
    fn the_usage_cache_keeps_the_last_reading() {
        let cache = SnapshotUsageCache::default();
        assert_eq!(cache.get("c1"), None);
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(5);
        let t1 = t0 + SNAPSHOT_USAGE_PERIOD;
        cache.put(
            "c1",
            SnapshotUsage {
                bytes: 1,
                inodes: 2,
            },
            t0,
        );
        cache.put(
            "c2",
            SnapshotUsage {
                bytes: 9,
                inodes: 9,
            },
            t0,
        );
        cache.put(
            "c1",
            SnapshotUsage {
                bytes: 3,
                inodes: 4,
            },
            t1,
        );
        assert_eq!(
            cache.get("c1"),
            Some((
                SnapshotUsage {
                    bytes: 3,
                    inodes: 4
                },
                t1
            ))
        );
        cache.forget("c2");
        assert_eq!(cache.ids(), vec!["c1".to_owned()]);
    }

    fn write(dir: &Path, name: &str, text: &str) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join(name), text).unwrap();
    }

    const HYBRID: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime shared:9 - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    #[test]
    fn detects_hybrid_as_v1_and_unified_as_v2() {
        assert_eq!(
            CgroupLayout::from_mountinfo(HYBRID),
            CgroupLayout::V1 {
                memory: Some("/sys/fs/cgroup/memory".into()),
                cpuacct: Some("/sys/fs/cgroup/cpuacct".into()),
                pids: Some("/sys/fs/cgroup/pids".into()),
            }
        );
        let joined = "25 20 0:22 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n";
        assert!(matches!(
            CgroupLayout::from_mountinfo(joined),
            CgroupLayout::V1 { cpuacct: Some(p), memory: None, .. } if p == Path::new("/sys/fs/cgroup/cpu,cpuacct")
        ));
        let v2 = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n";
        assert_eq!(
            CgroupLayout::from_mountinfo(v2),
            CgroupLayout::V2 {
                root: "/sys/fs/cgroup".into()
            }
        );
        let escaped = "30 23 0:26 / /tmp/a\\040b rw - cgroup2 cgroup2 rw\n";
        assert_eq!(
            CgroupLayout::from_mountinfo(escaped),
            CgroupLayout::V2 {
                root: "/tmp/a b".into()
            }
        );
    }

    #[test]
    fn reads_v1_fixture() {
        let root = tempfile::tempdir().unwrap();
        let mem = root.path().join("memory");
        let cpu = root.path().join("cpuacct");
        let pids = root.path().join("pids");
        let c = "cubelet/abc";
        write(&mem.join(c), "memory.usage_in_bytes", "10000\n");
        write(
            &mem.join(c),
            "memory.stat",
            "cache 1\nrss 5\ninactive_file 9\npgfault 3\ntotal_rss 4096\ntotal_inactive_file 1000\ntotal_pgfault 77\ntotal_pgmajfault 2\n",
        );
        write(
            &mem.join(c),
            "memory.limit_in_bytes",
            "9223372036854771712\n",
        );
        write(&cpu.join(c), "cpuacct.usage", "123456789\n");
        write(&pids.join(c), "pids.current", "3\n");
        let layout = CgroupLayout::V1 {
            memory: Some(mem.clone()),
            cpuacct: Some(cpu),
            pids: Some(pids),
        };
        let s = layout.read("/cubelet/abc");
        assert_eq!(s.cpu_usage_ns, Some(123_456_789));
        assert_eq!(s.processes, Some(3));
        let m = s.memory.unwrap();
        assert_eq!(
            m,
            MemoryStats {
                usage_bytes: 10000,
                working_set_bytes: 9000,
                rss_bytes: 4096,
                page_faults: 77,
                major_page_faults: 2,
                limit_bytes: None,
            }
        );
        assert_eq!(m.available_bytes(), None);
        // A limited cgroup reports what is left.
        write(&mem.join(c), "memory.limit_in_bytes", "20000\n");
        let m = layout.read("cubelet/abc").memory.unwrap();
        assert_eq!(m.limit_bytes, Some(20000));
        assert_eq!(m.available_bytes(), Some(11000));
        // The usage alone: everything but the process count.
        let usage = layout.read_usage("/cubelet/abc");
        assert_eq!(usage.processes, None);
        assert_eq!(
            usage,
            CgroupStats {
                processes: None,
                ..layout.read("/cubelet/abc")
            }
        );
        // A cgroup that is gone reads as empty.
        assert!(layout.read("/cubelet/gone").is_empty());
        assert!(layout.read_usage("/cubelet/gone").is_empty());
        // OOM kills, from memory.oom_control.
        assert_eq!(layout.oom_kills("/cubelet/abc"), None);
        write(
            &mem.join(c),
            "memory.oom_control",
            "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n",
        );
        assert_eq!(layout.oom_kills("/cubelet/abc"), Some(1));
        assert_eq!(layout.oom_kills("/cubelet/gone"), None);
    }

    #[test]
    fn open_files_are_read_again_from_the_start_and_closed_when_unwanted() {
        let root = tempfile::tempdir().unwrap();
        let layout = CgroupLayout::V2 {
            root: root.path().to_path_buf(),
        };
        let (a, b) = (root.path().join("pods/aaaa"), root.path().join("pods/bbbb"));
        for d in [&a, &b] {
            write(d, "cpu.stat", "usage_usec 1\n");
            write(d, "memory.current", "100\n");
            write(d, "memory.stat", "anon 10\ninactive_file 1\n");
            write(d, "memory.max", "max\n");
            write(d, "pids.current", "2\n");
        }
        let files = OpenFiles::default();
        let first = layout.read_with("/pods/aaaa", true, &files);
        assert_eq!(first, layout.read("/pods/aaaa"));
        assert_eq!(files.len(), 5);
        // The files stay open and are read again from their start.
        write(&a, "memory.current", "200\n");
        write(&a, "cpu.stat", "usage_usec 3\n");
        let second = layout.read_with("/pods/aaaa", false, &files);
        assert_eq!(second.memory.unwrap().usage_bytes, 200);
        assert_eq!(second.cpu_usage_ns, Some(3000));
        assert_eq!(second.processes, None);
        assert_eq!(files.len(), 5);
        layout.read_with("pods/bbbb", true, &files);
        assert_eq!(files.len(), 10);
        // Only the cgroups still wanted keep their files.
        files.retain(|id| id == "bbbb");
        assert_eq!(files.len(), 5);
        // (A removed cgroup's open files fail to read, which closes them; a
        // fixture's unlinked files still read, so only `retain` is shown.)
        files.retain(|_| false);
        assert!(files.is_empty());
        // A cgroup that does not exist opens nothing.
        assert!(layout.read_with("pods/gone", true, &files).is_empty());
        assert!(files.is_empty());
        // A file that is not there is looked for again by the next call,
        // and the files that are stay open meanwhile.
        std::fs::remove_file(b.join("pids.current")).unwrap();
        assert_eq!(layout.read_with("pods/bbbb", true, &files).processes, None);
        assert_eq!(files.len(), 4);
        write(&b, "pids.current", "7\n");
        assert_eq!(
            layout.read_with("pods/bbbb", true, &files).processes,
            Some(7)
        );
        assert_eq!(files.len(), 5);
    }

    #[test]
    fn reads_v2_fixture() {
        let root = tempfile::tempdir().unwrap();
        let d = root.path().join("kubepods/pod1/c1");
        write(
            &d,
            "cpu.stat",
            "usage_usec 2500\nuser_usec 2000\nsystem_usec 500\n",
        );
        write(&d, "memory.current", "8192\n");
        write(
            &d,
            "memory.stat",
            "anon 4096\nfile 4096\ninactive_file 1024\npgfault 10\npgmajfault 1\n",
        );
        write(&d, "memory.max", "max\n");
        write(&d, "cgroup.procs", "12\n13\n");
        let layout = CgroupLayout::V2 {
            root: root.path().to_path_buf(),
        };
        let s = layout.read("/kubepods/pod1/c1");
        assert_eq!(s.cpu_usage_ns, Some(2_500_000));
        // No pids controller file: counted from cgroup.procs.
        assert_eq!(s.processes, Some(2));
        let m = s.memory.unwrap();
        assert_eq!(m.usage_bytes, 8192);
        assert_eq!(m.working_set_bytes, 7168);
        assert_eq!(m.rss_bytes, 4096);
        assert_eq!((m.page_faults, m.major_page_faults), (10, 1));
        assert_eq!(m.limit_bytes, None);
        write(&d, "memory.max", "16384\n");
        write(&d, "pids.current", "5\n");
        let s = layout.read("kubepods/pod1/c1");
        assert_eq!(s.memory.unwrap().available_bytes(), Some(16384 - 7168));
        assert_eq!(s.processes, Some(5));
        assert_eq!(
            layout.read_usage("kubepods/pod1/c1"),
            CgroupStats {
                processes: None,
                ..s
            }
        );
        assert!(layout.read("/kubepods/none").is_empty());
        write(
            &d,
            "memory.events",
            "low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\noom_group_kill 0\n",
        );
        assert_eq!(layout.oom_kills("kubepods/pod1/c1"), Some(2));
    }

    #[test]
    fn parses_pressure_files() {
        let cpu = "some avg10=1.50 avg60=0.25 avg300=0.00 total=123456\n\
                   full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n";
        let p = parse_pressure(cpu).unwrap();
        assert_eq!(
            p.some,
            PsiData {
                avg10: 1.5,
                avg60: 0.25,
                avg300: 0.0,
                total_us: 123_456
            }
        );
        assert_eq!(p.full, Some(PsiData::default()));
        // A kernel without `full` for CPU (before 5.13).
        let p = parse_pressure("some avg10=0.00 avg60=0.00 avg300=0.00 total=7\n").unwrap();
        assert_eq!(p.some.total_us, 7);
        assert_eq!(p.full, None);
        // Malformed or empty: nothing.
        assert_eq!(parse_pressure(""), None);
        assert_eq!(
            parse_pressure("some avg10=x avg60=0 avg300=0 total=1\n"),
            None
        );
        assert_eq!(
            parse_pressure("full avg10=0 avg60=0 avg300=0 total=1\n"),
            None
        );
    }

    #[test]
    fn io_stat_is_summed_over_devices() {
        let text = "8:0 rbytes=1024 wbytes=2048 rios=1 wios=2 dbytes=0 dios=0\n\
                    253:1 rbytes=10 wbytes=20 rios=3 wios=4 dbytes=5 dios=6\n";
        assert_eq!(
            parse_io_stat(text),
            Some(IoStats {
                read_bytes: 1034,
                write_bytes: 2068,
                read_ops: 4,
                write_ops: 6,
            })
        );
        // No I/O yet: an empty file, zeros.
        assert_eq!(parse_io_stat(""), Some(IoStats::default()));
    }

    /// A cgroup v2 tree as the systemd driver lays it out: the scope of a
    /// container in kubelet's pod slice, with the pressure and I/O files
    /// of a v2 node, read through the path the driver gives.
    #[test]
    fn reads_a_systemd_scope_on_v2_with_psi_and_io() {
        use crate::cgroup::CgroupDriver;
        let root = tempfile::tempdir().unwrap();
        let parent = "kubepods-burstable-pod1.slice";
        let rel = CgroupDriver::Systemd.container_dir(Some(parent), "c1");
        let d = root.path().join(rel.trim_start_matches('/'));
        assert!(d.ends_with(
            "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice/cubelet-c1.scope"
        ));
        write(&d, "cpu.stat", "usage_usec 10\n");
        write(&d, "memory.current", "4096\n");
        write(&d, "memory.stat", "anon 1024\ninactive_file 1000\n");
        write(&d, "memory.max", "8192\n");
        write(&d, "pids.current", "3\n");
        write(&d, "io.stat", "8:0 rbytes=5 wbytes=6 rios=1 wios=2\n");
        let psi = "some avg10=2.00 avg60=1.00 avg300=0.50 total=900\n\
                   full avg10=1.00 avg60=0.50 avg300=0.25 total=400\n";
        for f in ["cpu.pressure", "memory.pressure", "io.pressure"] {
            write(&d, f, psi);
        }
        write(&d, "memory.events", "oom 1\noom_kill 1\n");
        let layout = CgroupLayout::V2 {
            root: root.path().to_path_buf(),
        };
        let files = OpenFiles::default();
        for s in [layout.read(&rel), layout.read_with(&rel, true, &files)] {
            assert_eq!(s.cpu_usage_ns, Some(10_000));
            let m = s.memory.unwrap();
            assert_eq!((m.usage_bytes, m.working_set_bytes), (4096, 3096));
            assert_eq!(m.limit_bytes, Some(8192));
            assert_eq!(s.processes, Some(3));
            assert_eq!(s.io.unwrap().read_bytes, 5);
            for p in [s.psi.cpu, s.psi.memory, s.psi.io] {
                let p = p.unwrap();
                assert_eq!(p.some.avg10, 2.0);
                assert_eq!(p.full.unwrap().total_us, 400);
            }
        }
        assert_eq!(layout.oom_kills(&rel), Some(1));
        // The scope's open files are the container's: kept for its id.
        assert!(!files.is_empty());
        files.retain(|id| id == "c1");
        assert!(!files.is_empty());
        files.retain(|id| id != "c1");
        assert!(files.is_empty());
        // The pod's slice, as the driver names it, is a cgroup too.
        let pod = CgroupDriver::Systemd.parent_dir(parent).unwrap();
        write(
            &root.path().join(pod.trim_start_matches('/')),
            "cpu.stat",
            "usage_usec 99\n",
        );
        assert_eq!(layout.read(&pod).cpu_usage_ns, Some(99_000));
        // v1 has no PSI and no io.stat readings.
        let v1 = tempfile::tempdir().unwrap();
        write(&v1.path().join("cubelet/c"), "io.stat", "8:0 rbytes=1\n");
        let v1_layout = CgroupLayout::V1 {
            memory: Some(v1.path().to_path_buf()),
            cpuacct: Some(v1.path().to_path_buf()),
            pids: None,
        };
        let s = v1_layout.read("/cubelet/c");
        assert_eq!(s.io, None);
        assert!(s.psi.is_empty());
    }

    /// A pressure file that opens but cannot be read (PSI off in the
    /// kernel: `EOPNOTSUPP`; here a directory of that name, `EISDIR`)
    /// leaves the cgroup's other files open, and the reading without PSI.
    #[test]
    fn an_unreadable_pressure_file_keeps_the_other_files_open() {
        let root = tempfile::tempdir().unwrap();
        let d = root.path().join("pods/c1");
        write(&d, "cpu.stat", "usage_usec 1\n");
        write(&d, "memory.current", "100\n");
        std::fs::create_dir_all(d.join("cpu.pressure")).unwrap();
        let layout = CgroupLayout::V2 {
            root: root.path().to_path_buf(),
        };
        let files = OpenFiles::default();
        let s = layout.read_with("/pods/c1", false, &files);
        assert_eq!(s.cpu_usage_ns, Some(1000));
        assert_eq!(s.psi.cpu, None);
        let open = files.len();
        assert!(open >= 2, "{open} files open");
        layout.read_with("/pods/c1", false, &files);
        assert_eq!(files.len(), open);
    }

    #[test]
    fn sums_container_cgroups() {
        let mut total = CgroupStats::default();
        let one = CgroupStats {
            cpu_usage_ns: Some(10),
            memory: Some(MemoryStats {
                usage_bytes: 100,
                working_set_bytes: 80,
                rss_bytes: 50,
                page_faults: 1,
                major_page_faults: 0,
                limit_bytes: Some(1000),
            }),
            processes: Some(1),
            ..Default::default()
        };
        total.accumulate(&one);
        total.accumulate(&one);
        total.accumulate(&CgroupStats::default());
        assert_eq!(total.cpu_usage_ns, Some(20));
        assert_eq!(total.processes, Some(2));
        let m = total.memory.unwrap();
        assert_eq!(
            (m.usage_bytes, m.working_set_bytes, m.rss_bytes),
            (200, 160, 100)
        );
        assert_eq!(m.limit_bytes, None);
    }

    #[test]
    fn cpu_rate_between_samples() {
        let a = CpuSample {
            timestamp_ns: 1_000_000_000,
            usage_ns: 5_000_000_000,
        };
        // Half a core over two seconds.
        let b = CpuSample {
            timestamp_ns: 3_000_000_000,
            usage_ns: 6_000_000_000,
        };
        assert_eq!(cpu_nano_cores(&a, &b), Some(500_000_000));
        // Two cores busy.
        let c = CpuSample {
            timestamp_ns: 4_000_000_000,
            usage_ns: 8_000_000_000,
        };
        assert_eq!(cpu_nano_cores(&b, &c), Some(2_000_000_000));
        // Same instant or going back in time: no rate.
        assert_eq!(cpu_nano_cores(&b, &b), None);
        assert_eq!(cpu_nano_cores(&c, &a), None);
        // Counter reset: zero, not a wrap-around.
        let reset = CpuSample {
            timestamp_ns: 5_000_000_000,
            usage_ns: 1,
        };
        assert_eq!(cpu_nano_cores(&c, &reset), Some(0));
    }

    #[test]
    fn parses_net_dev() {
        let text = "Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo:     100       1    0    0    0     0          0         0      100       1    0    0    0     0       0          0
  eth0: 4012003   18757    7    0    0     0          0         0  1159011   12137    2    0    0     0       0          0
";
        assert_eq!(
            parse_net_dev(text),
            vec![InterfaceStats {
                name: "eth0".into(),
                rx_bytes: 4_012_003,
                rx_errors: 7,
                tx_bytes: 1_159_011,
                tx_errors: 2,
            }]
        );
        // Our own namespace has at least a readable file.
        assert!(read_net_dev(std::process::id()).is_ok());
        assert!(read_net_dev(u32::MAX).unwrap_err().is_not_found());
    }
}
