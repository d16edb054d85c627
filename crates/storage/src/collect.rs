//! Local storage as a garbage collector (sandbox directories, shm and
//! scratch mounts).

use async_trait::async_trait;
use cubelet_engine::{blocking, Collector, GcReport, LiveSandboxes};

use crate::LocalStorage;

#[async_trait]
impl Collector for LocalStorage {
    fn name(&self) -> &'static str {
        "storage"
    }

    async fn collect(&self, live: &dyn LiveSandboxes) -> GcReport {
        let mut report = GcReport::default();
        // Umounts and tree removals block: keep them off the async workers.
        match blocking(|| self.gc(live)) {
            Ok(r) => {
                report.add("directory", r.dirs);
                report.add("mount", r.mounts);
                for e in &r.errors {
                    report.fail("storage", e);
                }
            }
            Err(e) => report.fail("storage", &e),
        }
        report
    }
}
