//! Processes run in a running container (`ExecSync`), their output capped.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use containerd_client::services::v1::{DeleteProcessRequest, ExecProcessRequest, StartRequest};
use nix::sys::signal::Signal;
use tokio::io::AsyncReadExt;
use tokio::task::JoinHandle;

use super::{json_any, unix_nanos, ContainerRuntime, PROCESS_TYPE_URL};
use crate::error::{cd, cd_process, RuntimeError};
use crate::io::{self as fifo_io, Fifos};
use tracing::Instrument;

/// Most output `exec_sync` keeps per stream: 8 MiB less 4 KiB, so that
/// both streams, the truncation marker and the message framing stay below
/// the 16 MiB gRPC message limit of the CRI socket (and kubelet's). What
/// is past it is read and dropped, so the process never blocks on a full
/// pipe and is reaped as any other.
pub const MAX_EXEC_OUTPUT: usize = 8 * 1024 * 1024 - 4096;

/// Output all `exec_sync` calls of the agent may hold at once beyond each
/// stream's first [`EXEC_OUTPUT_FREE`] bytes. Exec probes run on the
/// tenant's command, and kubelet runs up to three per container at a time:
/// without a shared bound, a few hundred probes printing 16 MiB each would
/// hold gigabytes of the agent's memory. A stream that finds the budget
/// spent keeps what it has and the rest is read and dropped, said by its
/// [`truncation_marker`].
pub const EXEC_OUTPUT_BUDGET: usize = 128 * 1024 * 1024;

/// What every stream of every `exec_sync` keeps without drawing on
/// [`EXEC_OUTPUT_BUDGET`]: a probe's or a command's usual output never
/// depends on what other calls hold.
pub const EXEC_OUTPUT_FREE: usize = 64 * 1024;

/// The budget's unit, in bytes (a permit of [`EXEC_BUDGET`]).
const BUDGET_UNIT: usize = 1024;

/// [`EXEC_OUTPUT_BUDGET`], in [`BUDGET_UNIT`]s: taken without waiting, and
/// given back when a call's output is returned or dropped.
static EXEC_BUDGET: tokio::sync::Semaphore =
    tokio::sync::Semaphore::const_new(EXEC_OUTPUT_BUDGET / BUDGET_UNIT);

/// The line appended to stderr when a stream was cut (at
/// [`MAX_EXEC_OUTPUT`], or earlier when [`EXEC_OUTPUT_BUDGET`] was spent):
/// `[cubelet: exec stdout truncated: kept 8384512 of 20971520 bytes]`.
pub fn truncation_marker(stream: &str, kept: usize, total: u64) -> String {
    let why = if kept < MAX_EXEC_OUTPUT {
        " (the agent's exec output budget was in use)"
    } else {
        ""
    };
    format!("\n[cubelet: exec {stream} truncated: kept {kept} of {total} bytes{why}]\n")
}

/// Output of [`ContainerRuntime::exec_sync`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutput {
    /// Standard output (capped at [`MAX_EXEC_OUTPUT`]).
    pub stdout: Vec<u8>,
    /// Standard error (capped at [`MAX_EXEC_OUTPUT`], then a
    /// [`truncation_marker`] line for each stream that was cut).
    pub stderr: Vec<u8>,
    /// Exit code.
    pub exit_code: i32,
}

impl ContainerRuntime {
    /// Runs `cmd` in the running container and collects its output. On
    /// timeout the process is killed and [`RuntimeError::Timeout`] returned.
    pub async fn exec_sync(
        &self,
        id: &str,
        cmd: &[String],
        timeout: Option<Duration>,
    ) -> Result<ExecOutput, RuntimeError> {
        if cmd.is_empty() {
            return Err(RuntimeError::InvalidArgument {
                field: "cmd".to_owned(),
                reason: "empty command".to_owned(),
            });
        }
        let container = self.get_container(id).await?;
        let any = container.spec.as_ref().ok_or_else(|| {
            RuntimeError::FailedPrecondition(format!("container {id} has no spec"))
        })?;
        let spec: oci_spec::runtime::Spec =
            serde_json::from_slice(&any.value).map_err(|source| RuntimeError::Json {
                what: "oci spec",
                source,
            })?;
        let mut process = spec.process().clone().ok_or_else(|| {
            RuntimeError::FailedPrecondition(format!("container {id} spec has no process"))
        })?;
        process.set_args(Some(cmd.to_vec()));
        process.set_terminal(Some(false));
        let exec_id = format!("exec-{}", unix_nanos(SystemTime::now()));
        let fifos = Fifos::create(self.io_dir(id).join(&exec_id), false, false)?;
        let result = self
            .exec_inner(id, &exec_id, &process, &fifos, timeout)
            .await;
        let _ = fifo_io::remove_dir(&fifos.dir);
        result
    }

    async fn exec_inner(
        &self,
        id: &str,
        exec_id: &str,
        process: &oci_spec::runtime::Process,
        fifos: &Fifos,
        timeout: Option<Duration>,
    ) -> Result<ExecOutput, RuntimeError> {
        let keepers = fifos.keep_open()?;
        let (_, stdout, stderr) = fifos.wire();
        self.client
            .tasks()
            .exec(self.client.request(ExecProcessRequest {
                container_id: id.to_owned(),
                stdin: String::new(),
                stdout,
                stderr,
                terminal: false,
                spec: Some(json_any(PROCESS_TYPE_URL, "process spec", process)?),
                exec_id: exec_id.to_owned(),
            }))
            .await
            .map_err(cd_process("tasks.exec", id))?;
        let res = self.exec_run(id, exec_id, fifos, keepers, timeout).await;
        let del = self
            .client
            .tasks()
            .delete_process(self.client.request(DeleteProcessRequest {
                container_id: id.to_owned(),
                exec_id: exec_id.to_owned(),
            }))
            .await;
        if let Err(s) = del {
            if s.code() != tonic::Code::NotFound {
                tracing::warn!(container = id, exec_id, error = %s, "deleting exec process failed");
            }
        }
        res
    }

    async fn exec_run(
        &self,
        id: &str,
        exec_id: &str,
        fifos: &Fifos,
        keepers: fifo_io::Keepers,
        timeout: Option<Duration>,
    ) -> Result<ExecOutput, RuntimeError> {
        self.client
            .tasks()
            .start(self.client.request(StartRequest {
                container_id: id.to_owned(),
                exec_id: exec_id.to_owned(),
            }))
            .await
            .map_err(cd("tasks.start"))?;
        // The shim opened its write ends when the process started.
        let readers = fifos.open_readers()?;
        drop(keepers);
        let (out_buf, err_buf) = (Shared::default(), Shared::default());
        let out = tokio::spawn(read_capped(readers.stdout, Arc::clone(&out_buf)).in_current_span());
        let err = readers
            .stderr
            .map(|r| tokio::spawn(read_capped(r, Arc::clone(&err_buf)).in_current_span()));
        let waited = match timeout.filter(|t| !t.is_zero()) {
            Some(t) => match tokio::time::timeout(t, self.wait(id, exec_id)).await {
                Ok(r) => r,
                Err(_) => {
                    self.kill(id, exec_id, Signal::SIGKILL).await?;
                    let _ = self.wait(id, exec_id).await;
                    out.abort();
                    if let Some(e) = err {
                        e.abort();
                    }
                    return Err(RuntimeError::Timeout {
                        op: "exec",
                        id: id.to_owned(),
                        timeout: t,
                    });
                }
            },
            None => self.wait(id, exec_id).await,
        };
        let (code, _) = waited?;
        // Output ends when the shim closes the FIFOs after the process
        // exits; a background child still holding them must not hang the
        // call, nor cost it what was already read.
        let deadline = tokio::time::Instant::now() + DRAIN;
        let stdout = collect(Some(out), &out_buf, deadline).await;
        let stderr = collect(err, &err_buf, deadline).await;
        let (stdout, stderr) = join_output(stdout, stderr);
        Ok(ExecOutput {
            stdout,
            stderr,
            exit_code: i32::try_from(code).unwrap_or(i32::MAX),
        })
    }
}

/// One stream's output: its first [`MAX_EXEC_OUTPUT`] bytes (fewer when
/// [`EXEC_OUTPUT_BUDGET`] was spent) and how many it wrote in all.
#[derive(Debug)]
struct Captured {
    kept: Vec<u8>,
    total: u64,
    /// Where the budget is drawn from: [`EXEC_BUDGET`] but in tests.
    pool: &'static tokio::sync::Semaphore,
    /// The share of `pool` that `kept`'s capacity holds past
    /// [`EXEC_OUTPUT_FREE`]; given back on drop.
    budget: Option<tokio::sync::SemaphorePermit<'static>>,
    /// The budget was spent: nothing more is kept.
    starved: bool,
}

impl Default for Captured {
    fn default() -> Self {
        Self {
            kept: Vec::new(),
            total: 0,
            pool: &EXEC_BUDGET,
            budget: None,
            starved: false,
        }
    }
}

impl Captured {
    /// Keeps `bytes` as far as [`MAX_EXEC_OUTPUT`] and the budget allow,
    /// counting them all.
    fn push(&mut self, bytes: &[u8]) {
        self.total = self.total.saturating_add(bytes.len() as u64);
        let room = MAX_EXEC_OUTPUT.saturating_sub(self.kept.len());
        let take = bytes.len().min(room);
        if take == 0 || self.starved {
            return;
        }
        let len = self.kept.len() + take;
        if len > self.kept.capacity() {
            // Doubling as a Vec would, within the cap (`len` is in it).
            let cap = self
                .kept
                .capacity()
                .saturating_mul(2)
                .clamp(4096, MAX_EXEC_OUTPUT)
                .max(len);
            if !self.reserve_budget(cap) {
                self.starved = true;
                return;
            }
            self.kept.reserve_exact(cap - self.kept.len());
        }
        self.kept.extend_from_slice(&bytes[..take]);
    }

    /// Takes what a capacity of `cap` bytes needs of [`EXEC_BUDGET`] beyond
    /// what is held; false when the budget cannot give it.
    fn reserve_budget(&mut self, cap: usize) -> bool {
        let units = cap.saturating_sub(EXEC_OUTPUT_FREE).div_ceil(BUDGET_UNIT);
        let held = self.budget.as_ref().map_or(0, |p| p.num_permits());
        if units <= held {
            return true;
        }
        let Ok(more) = u32::try_from(units - held) else {
            return false;
        };
        match self.pool.try_acquire_many(more) {
            Ok(p) => {
                match &mut self.budget {
                    Some(held) => held.merge(p),
                    None => self.budget = Some(p),
                }
                true
            }
            Err(_) => false,
        }
    }
}

/// What a stream's reader has captured so far, shared with the caller so
/// a reader given up on still hands over what it read.
type Shared = Arc<std::sync::Mutex<Captured>>;

/// How long the output may take to end once the process has exited (both
/// streams together).
const DRAIN: Duration = Duration::from_secs(5);

async fn read_capped<R: tokio::io::AsyncRead + Unpin>(mut r: R, out: Shared) {
    let mut buf = vec![0u8; 32 * 1024];
    loop {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => out
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(&buf[..n]),
        }
    }
}

/// stdout and stderr as returned: stderr ends with a marker line for each
/// stream that was cut.
fn join_output(stdout: Captured, stderr: Captured) -> (Vec<u8>, Vec<u8>) {
    let cuts = [
        ("stdout", stdout.kept.len(), stdout.total),
        ("stderr", stderr.kept.len(), stderr.total),
    ];
    let mut err = stderr.kept;
    for (name, kept, total) in cuts {
        if total > kept as u64 {
            tracing::info!(stream = name, total, kept, "exec output truncated");
            err.extend_from_slice(truncation_marker(name, kept, total).as_bytes());
        }
    }
    (stdout.kept, err)
}

/// Waits for a stream's reader until `deadline`, then gives up on it;
/// what it read is kept either way.
async fn collect(
    h: Option<JoinHandle<()>>,
    out: &Shared,
    deadline: tokio::time::Instant,
) -> Captured {
    if let Some(mut h) = h {
        if tokio::time::timeout_at(deadline, &mut h).await.is_err() {
            h.abort();
            tracing::debug!("exec output still open after the process exited: kept what was read");
        }
    }
    std::mem::take(
        &mut *out
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream captured with a budget of `units` of its own.
    fn with_pool(units: usize) -> Captured {
        Captured {
            pool: Box::leak(Box::new(tokio::sync::Semaphore::new(units))),
            ..Captured::default()
        }
    }

    /// A hostile probe printing as much as it can while the budget is held
    /// by others: it keeps its free share and the cut says why; a small
    /// output never needs the budget; what is held is given back.
    #[test]
    fn output_past_the_free_share_draws_on_the_shared_budget() {
        // 1 MiB of budget: the first stream gets its 64 KiB free share plus
        // about 1 MiB, then is cut.
        let mut big = with_pool(1024);
        let chunk = vec![b'x'; 32 * 1024];
        for _ in 0..64 {
            big.push(&chunk);
        }
        assert_eq!(big.total, 2 * 1024 * 1024);
        assert!(big.starved);
        assert!(big.kept.len() >= EXEC_OUTPUT_FREE, "{}", big.kept.len());
        assert!(
            big.kept.len() <= EXEC_OUTPUT_FREE + 1024 * 1024,
            "{}",
            big.kept.len()
        );
        // Capacity is what is paid for.
        let paid = big.budget.as_ref().map_or(0, |p| p.num_permits()) * BUDGET_UNIT;
        assert!(big.kept.capacity() <= EXEC_OUTPUT_FREE + paid);
        let pool = big.pool;
        // Another stream on the spent budget still keeps a probe's output.
        let mut small = Captured {
            pool,
            ..Captured::default()
        };
        small.push(b"ok\n");
        assert_eq!(
            (small.kept.as_slice(), small.starved),
            (&b"ok\n"[..], false)
        );
        let (_, stderr) = join_output(big, Captured::default());
        let text = String::from_utf8_lossy(&stderr).into_owned();
        assert!(text.contains("exec stdout truncated"), "{text}");
        assert!(text.contains("of 2097152 bytes"), "{text}");
        assert!(text.contains("exec output budget"), "{text}");
        // Dropped with the output: the whole budget is free again.
        assert_eq!(pool.available_permits(), 1024);
    }

    async fn captured<R: tokio::io::AsyncRead + Unpin>(r: R) -> Captured {
        let out = Shared::default();
        read_capped(r, Arc::clone(&out)).await;
        let c = std::mem::take(&mut *out.lock().unwrap());
        c
    }

    /// A background child holding the output open: the call gives up on
    /// the stream at the deadline and keeps what was already read (it
    /// returned nothing before, after 5 s per stream).
    #[tokio::test]
    async fn output_still_open_at_the_deadline_keeps_what_was_read() {
        use tokio::io::AsyncWriteExt as _;
        let (mut w, r) = tokio::io::duplex(64);
        let out = Shared::default();
        let h = tokio::spawn(read_capped(r, Arc::clone(&out)));
        w.write_all(b"hi\n").await.unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_millis(300);
        let got = collect(Some(h), &out, deadline).await;
        assert_eq!(got.kept, b"hi\n");
        assert_eq!(got.total, 3);
        // The other stream, past the shared deadline, is taken as it is.
        let (_w2, r2) = tokio::io::duplex(64);
        let err = Shared::default();
        let h2 = tokio::spawn(read_capped(r2, Arc::clone(&err)));
        assert!(collect(Some(h2), &err, deadline).await.kept.is_empty());
        drop(w);
    }

    /// 20 MiB on each stream (the old code kept 16 MiB of each: 32 MiB, past
    /// the 16 MiB gRPC limit, so the answer was never delivered): both are
    /// cut, everything is still read (the writer never blocks), the cut is
    /// said on stderr, and the answer fits in a 16 MiB message.
    #[tokio::test]
    async fn output_is_capped_below_the_grpc_limit_and_the_cut_is_visible() {
        let big = 20 * 1024 * 1024;
        let out = captured(tokio::io::repeat(b'o').take(big)).await;
        let err = captured(tokio::io::repeat(b'e').take(big)).await;
        assert_eq!((out.total, err.total), (big, big));
        let (stdout, stderr) = join_output(out, err);
        assert_eq!(stdout.len(), MAX_EXEC_OUTPUT);
        let text = String::from_utf8_lossy(&stderr[MAX_EXEC_OUTPUT..]).into_owned();
        assert!(text.contains("exec stdout truncated"), "{text}");
        assert!(text.contains("exec stderr truncated"), "{text}");
        // The CRI answer: two length-delimited byte fields and an int.
        let message = stdout.len() + stderr.len() + 32;
        assert!(message < 16 * 1024 * 1024, "{message} bytes");
    }

    #[tokio::test]
    async fn output_under_the_cap_is_kept_whole_without_a_marker() {
        let out = captured(&b"hello"[..]).await;
        let err = captured(&b"oops"[..]).await;
        assert_eq!(join_output(out, err), (b"hello".to_vec(), b"oops".to_vec()));
    }
}
