//! CRI log files: copies a container's stdout/stderr into the file kubelet
//! reads, one entry per line in the CRI format
//! `<RFC3339Nano> <stdout|stderr> <P|F> <text>\n`.
//!
//! Lines longer than [`MAX_LINE`] are split into partial (`P`) entries; a
//! last line without a newline is written as a partial entry when the stream
//! ends, as containerd does. Both streams of a container share one
//! [`LogSink`], which can reopen its file after kubelet rotated it, and
//! which may hold the container to a rate ([`LogSink::with_rate_limit`]):
//! past it the copiers stop reading for a while, the pipe fills and the
//! container's writes block, as they would on a slow disk.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::sync::Mutex;

use crate::error::RuntimeError;

/// Longest line content written in one entry (kubelet's and containerd's 16 KiB).
pub const MAX_LINE: usize = 16 * 1024;

/// Which output stream an entry came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

impl Stream {
    /// The stream's name in the log format.
    pub fn as_str(self) -> &'static str {
        match self {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
        }
    }
}

/// Formats `ts` as Go's `time.RFC3339Nano` in UTC (trailing zeros of the
/// fraction trimmed, no fraction when it is zero).
pub fn rfc3339_nano(ts: SystemTime) -> String {
    let d = ts.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let nanos = d.subsec_nanos();
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let rem = secs % 86_400;
    let (h, m, s) = (rem / 3600, (rem % 3600) / 60, rem % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let mut out = format!("{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{s:02}");
    if nanos != 0 {
        let frac = format!("{nanos:09}");
        out.push('.');
        out.push_str(frac.trim_end_matches('0'));
    }
    out.push('Z');
    out
}

/// Appends one CRI log entry stamped `ts` (already formatted) to `out`.
fn push_entry(out: &mut Vec<u8>, ts: &[u8], stream: Stream, partial: bool, text: &[u8]) {
    out.extend_from_slice(ts);
    out.push(b' ');
    out.extend_from_slice(stream.as_str().as_bytes());
    out.extend_from_slice(if partial { b" P " } else { b" F " });
    out.extend_from_slice(text);
    out.push(b'\n');
}

/// The log file of one container, shared by its stdout and stderr copiers.
#[derive(Debug)]
pub struct LogSink {
    path: Option<PathBuf>,
    file: Mutex<Option<tokio::fs::File>>,
    /// Every entry is also broadcast here (attach).
    tap: crate::io::exec_stream::OutputTap,
    /// The most log bytes a second both copiers may write, if limited.
    limit: Option<Throttle>,
    /// The last write failed (a full disk, typically): it may have left
    /// part of an entry, so the next write starts on a new line, and the
    /// failures of the spell are logged once.
    failing: std::sync::atomic::AtomicBool,
}

/// A log's rate limit: a token bucket holding [`Throttle::BURST`] worth of
/// bytes, kept as the instant until which the bytes written are paid for.
#[derive(Debug)]
struct Throttle {
    bytes_per_sec: u64,
    paid_until: std::sync::Mutex<Option<Instant>>,
    /// Whether the log already said this container is held back.
    said: std::sync::atomic::AtomicBool,
}

impl Throttle {
    /// How much a log may write at once after a quiet spell, in time at
    /// its rate.
    const BURST: Duration = Duration::from_secs(1);

    /// What a write costs at least, as a share of a second at the rate: a
    /// container printing one short line at a time (a shell's `echo` loop)
    /// makes one read and one write per line, and what that costs the agent
    /// is per write. Held to this, it makes at most about a thousand writes
    /// a second past its burst; its lines then wait in the pipe and a read
    /// takes many at once.
    const MIN_WRITE_SHARE: u64 = 1024;

    /// Charges a write of `bytes`; returns how long the writer must wait to
    /// stay within the rate.
    fn charge(&self, bytes: usize, now: Instant) -> Duration {
        let bytes = (bytes as u64).max(self.bytes_per_sec / Self::MIN_WRITE_SHARE);
        let cost = Duration::from_secs_f64(bytes as f64 / self.bytes_per_sec as f64);
        let floor = now.checked_sub(Self::BURST).unwrap_or(now);
        let mut paid = self
            .paid_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let until = paid.map_or(floor, |p| p.max(floor)) + cost;
        *paid = Some(until);
        until.saturating_duration_since(now)
    }
}

async fn open_log(path: &Path) -> Result<tokio::fs::File, RuntimeError> {
    if let Some(dir) = path.parent() {
        tokio::fs::create_dir_all(dir)
            .await
            .map_err(|source| RuntimeError::Io {
                op: "create log directory",
                path: dir.display().to_string(),
                source,
            })?;
    }
    let io = |op: &'static str| {
        let path = path.display().to_string();
        move |source| RuntimeError::Io { op, path, source }
    };
    let file = tokio::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(LOG_FILE_MODE)
        .open(path)
        .await
        .map_err(io("open log file"))?;
    // One an older version made 0644 is tightened.
    let mode = file
        .metadata()
        .await
        .map_err(io("stat log file"))?
        .permissions()
        .mode();
    if mode & 0o777 & !LOG_FILE_MODE != 0 {
        file.set_permissions(std::fs::Permissions::from_mode(LOG_FILE_MODE))
            .await
            .map_err(io("set mode of log file"))?;
    }
    Ok(file)
}

/// Mode of a container's CRI log file (as containerd's): owner writes,
/// group (the log collector's) reads, others nothing.
pub const LOG_FILE_MODE: u32 = 0o640;

impl LogSink {
    /// Opens (creating, appending) the log at `path`; `None` discards output.
    pub async fn open(path: Option<PathBuf>) -> Result<Self, RuntimeError> {
        let file = match &path {
            Some(p) => Some(open_log(p).await?),
            None => None,
        };
        Ok(Self {
            path,
            file: Mutex::new(file),
            tap: Default::default(),
            limit: None,
            failing: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Holds the log to `bytes_per_sec` bytes of entries a second (after a
    /// burst of a second's worth); `None` or 0 leaves it unlimited.
    pub fn with_rate_limit(mut self, bytes_per_sec: Option<u64>) -> Self {
        self.limit = bytes_per_sec
            .filter(|r| *r > 0)
            .map(|bytes_per_sec| Throttle {
                bytes_per_sec,
                paid_until: std::sync::Mutex::new(None),
                said: std::sync::atomic::AtomicBool::new(false),
            });
        self
    }

    /// The log path, if any.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The broadcast of the entries written (for attach).
    pub fn tap(&self) -> &crate::io::exec_stream::OutputTap {
        &self.tap
    }

    /// Closes the file and opens it again at the same path (after rotation).
    pub async fn reopen(&self) -> Result<(), RuntimeError> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        let mut guard = self.file.lock().await;
        if let Some(mut old) = guard.take() {
            // Best effort: the data was already handed to the kernel.
            let _ = old.flush().await;
        }
        *guard = Some(open_log(path).await?);
        self.failing
            .store(false, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Appends `entries` (whole CRI log entries) with one write, then
    /// waits as long as the rate limit asks.
    async fn write(&self, entries: &[u8]) {
        {
            let mut guard = self.file.lock().await;
            if let Some(f) = guard.as_mut() {
                use std::sync::atomic::Ordering::Relaxed;
                let failing = self.failing.load(Relaxed);
                let res = async {
                    if failing {
                        // End whatever part of an entry the failed write left.
                        f.write_all(b"\n").await?;
                    }
                    f.write_all(entries).await?;
                    f.flush().await
                }
                .await;
                match res {
                    Ok(()) if failing => {
                        self.failing.store(false, Relaxed);
                        tracing::info!(path = ?self.path, "writing container log works again");
                    }
                    Ok(()) => {}
                    // Once per spell: a container printing into a full disk
                    // must not flood the agent's own log.
                    Err(e) if !failing => {
                        self.failing.store(true, Relaxed);
                        tracing::warn!(
                            path = ?self.path,
                            error = %e,
                            "writing container log failed; its output is dropped, \
                             and said again only once a write has succeeded"
                        );
                    }
                    Err(_) => {}
                }
            }
        }
        let Some(limit) = &self.limit else {
            return;
        };
        let wait = limit.charge(entries.len(), Instant::now());
        if wait.is_zero() {
            return;
        }
        if !limit.said.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!(
                path = ?self.path,
                bytes_per_sec = limit.bytes_per_sec,
                "container log held to its rate limit (runtime.log_rate_limit): \
                 the container's output waits in its pipe"
            );
        }
        tokio::time::sleep(wait).await;
    }
}

/// Copies `reader` into `sink` until end of stream: each read goes to the
/// attach tap as it is, and into the log file cut into CRI entries (one per
/// line, `P` for pieces of lines longer than the limit and for a last line
/// without a newline).
///
/// The entries a read completes carry one time stamp (when the read
/// returned) and reach the file in one write, a few if they pass
/// [`WRITE_CHUNK`]: a container printing short lines as fast as it can
/// (`yes`) costs the agent about 0.1 µs a line, not a write and a thread
/// hop each (about 20 µs a line, a whole core of the agent at 47 000
/// lines/s, before).
///
/// The read buffer starts small and grows only while reads fill it: a node
/// holds two copiers per container and infra container, most of them idle
/// or writing short lines, and an idle one should not pin 64 KiB (at 250
/// pods a 4 KiB start was 4 MiB of the heap).
pub async fn copy_stream<R: AsyncRead + Unpin>(mut reader: R, stream: Stream, sink: Arc<LogSink>) {
    const SMALL: usize = 512;
    const LARGE: usize = 64 * 1024;
    // What an empty line buffer may keep between lines: more than the read
    // buffer's start, so lines of a few KiB do not reallocate each time.
    const LINE_KEEP: usize = 4 * 1024;
    let mut chunk = vec![0u8; SMALL];
    // A line begun in an earlier read (never a whole entry's worth).
    let mut line: Vec<u8> = Vec::new();
    let mut out: Vec<u8> = Vec::new();
    loop {
        let n = match reader.read(&mut chunk).await {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(stream = stream.as_str(), error = %e, "reading container output failed");
                break;
            }
        };
        let Some(mut rest) = chunk.get(..n).filter(|d| !d.is_empty()) else {
            if !line.is_empty() {
                let ts = rfc3339_nano(SystemTime::now());
                push_entry(&mut out, ts.as_bytes(), stream, true, &line);
                sink.write(&out).await;
            }
            break;
        };
        sink.tap.send(stream, rest);
        if sink.path.is_none() {
            // No log file: the output is the attach tap's only, as read,
            // and never held to the log's rate.
            rest = &[];
        }
        let ts = rfc3339_nano(SystemTime::now());
        let ts = ts.as_bytes();
        while !rest.is_empty() {
            let take = rest.len().min(MAX_LINE - line.len());
            match rest[..take].iter().position(|b| *b == b'\n') {
                Some(i) => {
                    let mut text = &rest[..i];
                    rest = &rest[i + 1..];
                    if !line.is_empty() {
                        line.extend_from_slice(text);
                        text = &line;
                    }
                    let text = text.strip_suffix(b"\r").unwrap_or(text);
                    push_entry(&mut out, ts, stream, false, text);
                    line.clear();
                }
                None if line.len() + take >= MAX_LINE => {
                    let text = if line.is_empty() {
                        &rest[..take]
                    } else {
                        line.extend_from_slice(&rest[..take]);
                        &line
                    };
                    push_entry(&mut out, ts, stream, true, text);
                    rest = &rest[take..];
                    line.clear();
                }
                None => {
                    line.extend_from_slice(&rest[..take]);
                    rest = &rest[take..];
                }
            }
            if out.len() >= WRITE_CHUNK {
                sink.write(&out).await;
                out.clear();
            }
        }
        if !out.is_empty() {
            sink.write(&out).await;
            out.clear();
        }
        if n == chunk.len() && chunk.len() < LARGE {
            chunk.resize(LARGE, 0);
        } else if n < SMALL && chunk.len() > SMALL {
            chunk.truncate(SMALL);
            chunk.shrink_to_fit();
            out.shrink_to(LINE_KEEP);
        }
        if line.is_empty() && line.capacity() > LINE_KEEP {
            line.shrink_to(LINE_KEEP);
        }
    }
}

/// Most log bytes a copier gathers before it writes them: a read of short
/// lines makes about twenty times its size in entries.
pub const WRITE_CHUNK: usize = 256 * 1024;

/// Parses one CRI log line into `(stream, partial, text)`; for tests and tools.
pub fn parse_entry(line: &str) -> Option<(&str, &str, bool, &str)> {
    let mut parts = line.splitn(4, ' ');
    let ts = parts.next()?;
    let stream = parts.next()?;
    let tag = parts.next()?;
    let text = parts.next().unwrap_or("");
    Some((ts, stream, tag == "P", text))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn rfc3339_nano_matches_go() {
        let t = UNIX_EPOCH + Duration::new(1_700_000_000, 123_400_000);
        assert_eq!(rfc3339_nano(t), "2023-11-14T22:13:20.1234Z");
        assert_eq!(rfc3339_nano(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        let leap = UNIX_EPOCH + Duration::new(951_782_400, 1); // 2000-02-29
        assert_eq!(rfc3339_nano(leap), "2000-02-29T00:00:00.000000001Z");
    }

    /// Logs were 0644 (any local user read every container's output);
    /// now 0640 as containerd's, and an older 0644 one is tightened.
    /// A full disk (found by a pod printing into a small log filesystem):
    /// each failed write logged a warning, 150 a second, and the part of an
    /// entry a failed write left was glued to the next entry.
    #[tokio::test]
    async fn a_failing_log_is_said_once_and_recovers_on_a_new_line() {
        let full = tokio::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .await
            .unwrap();
        let sink = LogSink {
            path: None,
            file: Mutex::new(Some(full)),
            tap: Default::default(),
            limit: None,
            failing: std::sync::atomic::AtomicBool::new(false),
        };
        sink.write(b"2026-12-07T20:29:17Z stdout F y\n").await;
        assert!(sink.failing.load(std::sync::atomic::Ordering::Relaxed));
        // Space comes back (here: another file under the same sink).
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.log");
        std::fs::write(&path, b"2026-12-07T20:29").unwrap(); // a torn entry
        *sink.file.lock().await = Some(open_log(&path).await.unwrap());
        sink.write(b"2026-12-07T20:29:18Z stdout F y\n").await;
        assert!(!sink.failing.load(std::sync::atomic::Ordering::Relaxed));
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "2026-12-07T20:29\n2026-12-07T20:29:18Z stdout F y\n"
        );
    }

    #[tokio::test]
    async fn log_files_are_0640() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.log");
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        drop(LogSink::open(Some(path.clone())).await.unwrap());
        assert_eq!(mode(&path), LOG_FILE_MODE);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        drop(LogSink::open(Some(path.clone())).await.unwrap());
        assert_eq!(mode(&path), 0o640);
    }

    #[tokio::test]
    async fn copies_lines_splits_long_ones_and_flushes_partial() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/c.log");
        let sink = Arc::new(LogSink::open(Some(path.clone())).await.unwrap());
        let long = "x".repeat(MAX_LINE + 10);
        let input = format!("hello\r\nworld\n{long}\ntail");
        copy_stream(input.as_bytes(), Stream::Stderr, sink.clone()).await;
        let text = std::fs::read_to_string(&path).unwrap();
        let entries: Vec<_> = text.lines().map(|l| parse_entry(l).unwrap()).collect();
        let got: Vec<(bool, usize)> = entries.iter().map(|e| (e.2, e.3.len())).collect();
        assert_eq!(
            got,
            vec![
                (false, 5),
                (false, 5),
                (true, MAX_LINE),
                (false, 10),
                (true, 4)
            ]
        );
        assert!(entries.iter().all(|e| e.1 == "stderr"));
        assert_eq!(entries[0].3, "hello");
        assert_eq!(entries[4].3, "tail");
        assert!(entries[0].0.ends_with('Z'));

        // Rotation: move the file away, reopen, and the next entries land in a new file.
        std::fs::rename(&path, dir.path().join("sub/c.log.1")).unwrap();
        sink.reopen().await.unwrap();
        copy_stream(&b"after\n"[..], Stream::Stdout, sink).await;
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.ends_with(" stdout F after\n"), "{text}");
    }

    #[test]
    fn the_throttle_lets_a_burst_through_then_holds_to_the_rate() {
        let t = Throttle {
            bytes_per_sec: 1000,
            paid_until: std::sync::Mutex::new(None),
            said: std::sync::atomic::AtomicBool::new(false),
        };
        let now = Instant::now() + Duration::from_secs(10);
        // A second's worth at once, then every byte waits its turn.
        assert_eq!(t.charge(1000, now), Duration::ZERO);
        assert_eq!(t.charge(500, now), Duration::from_millis(500));
        assert_eq!(t.charge(500, now), Duration::from_secs(1));
        // Time paid for passes.
        assert_eq!(
            t.charge(1000, now + Duration::from_secs(1)),
            Duration::from_secs(1)
        );
        // A quiet spell refills the burst, never more than a second's worth.
        let later = now + Duration::from_secs(60);
        assert_eq!(t.charge(1000, later), Duration::ZERO);
        assert_eq!(t.charge(1, later), Duration::from_millis(1));
        // A write costs at least a 1024th of a second at the rate.
        let t = Throttle {
            bytes_per_sec: 1 << 20,
            paid_until: std::sync::Mutex::new(None),
            said: std::sync::atomic::AtomicBool::new(false),
        };
        assert_eq!(t.charge(1 << 20, now), Duration::ZERO);
        assert_eq!(t.charge(1, now), Duration::from_secs_f64(1.0 / 1024.0));
        assert_eq!(t.charge(4096, now), Duration::from_secs_f64(5.0 / 1024.0));
        // No limit unless one is given.
        let unlimited = LogSink {
            failing: std::sync::atomic::AtomicBool::new(false),
            path: None,
            file: Mutex::new(None),
            tap: Default::default(),
            limit: None,
        };
        assert!(unlimited.with_rate_limit(Some(0)).limit.is_none());
    }

    #[tokio::test]
    async fn output_without_a_log_file_is_never_held_to_the_rate() {
        let sink = Arc::new(
            LogSink::open(None)
                .await
                .unwrap()
                .with_rate_limit(Some(64 << 10)),
        );
        // 8 MiB of `y` lines make 168 MiB of entries: 40 minutes at the rate.
        let input = "y\n".repeat(4 << 20);
        tokio::time::timeout(
            Duration::from_secs(30),
            copy_stream(input.as_bytes(), Stream::Stdout, sink),
        )
        .await
        .expect("copied without waiting");
    }

    /// Hands out at most `step` bytes a read.
    struct Trickle<'a> {
        data: &'a [u8],
        step: usize,
    }

    impl AsyncRead for Trickle<'_> {
        fn poll_read(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            let n = self.step.min(self.data.len()).min(buf.remaining());
            let (head, tail) = self.data.split_at(n);
            buf.put_slice(head);
            self.data = tail;
            std::task::Poll::Ready(Ok(()))
        }
    }

    /// (partial, text) of every entry the copier writes for `input`.
    async fn entries_of(input: &[u8], step: usize) -> Vec<(bool, String)> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.log");
        let sink = Arc::new(LogSink::open(Some(path.clone())).await.unwrap());
        copy_stream(Trickle { data: input, step }, Stream::Stdout, sink).await;
        std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .map(|l| {
                let (_, stream, partial, text) = parse_entry(l).unwrap();
                assert_eq!(stream, "stdout");
                (partial, text.to_owned())
            })
            .collect()
    }

    #[tokio::test]
    async fn entries_do_not_depend_on_how_the_output_was_read() {
        let exact = "e".repeat(MAX_LINE);
        let long = "l".repeat(2 * MAX_LINE + 3);
        let input = format!(
            "y\ny\r\n\n{exact}\n{long}\nmid\rdle\r\n{}tail",
            "z\n".repeat(5000)
        );
        let whole = entries_of(input.as_bytes(), usize::MAX).await;
        let mut want = vec![
            (false, "y".to_owned()),
            (false, "y".to_owned()),
            (false, String::new()),
            (true, exact.clone()),
            (false, String::new()),
            (true, "l".repeat(MAX_LINE)),
            (true, "l".repeat(MAX_LINE)),
            (false, "lll".to_owned()),
            (false, "mid\rdle".to_owned()),
        ];
        want.extend(std::iter::repeat_n((false, "z".to_owned()), 5000));
        want.push((true, "tail".to_owned()));
        assert_eq!(whole, want);
        for step in [1, 2, 3, 7, 512, MAX_LINE - 1, MAX_LINE + 1] {
            assert_eq!(
                entries_of(input.as_bytes(), step).await,
                want,
                "reads of {step} bytes"
            );
        }
    }
}
