//! The runtime as a garbage collector: shims it started whose task
//! containerd forgot, user-lookup mounts a crash left, and the namespace pins of sandboxes without an infra process that no
//! sandbox owns any more.

use async_trait::async_trait;
use cubelet_engine::{Collector, GcReport, LiveSandboxes};

use crate::container::ContainerRuntime;
use crate::sandbox::podns::PodNamespaces;

#[async_trait]
impl Collector for ContainerRuntime {
    fn name(&self) -> &'static str {
        "shims"
    }

    /// Shims are orphans by containerd's own task list, not by the store,
    /// so `live` is not asked.
    async fn collect(&self, _live: &dyn LiveSandboxes) -> GcReport {
        let mut report = GcReport::default();
        match self.reap_orphan_shims().await {
            Ok(n) => report.add("shim", n),
            Err(e) => report.fail("shim", &e),
        }
        let runtime = self;
        match cubelet_engine::blocking(|| runtime.clean_user_lookup_mounts()) {
            Ok(n) => report.add("user-lookup-mount", n),
            Err(e) => report.fail("user-lookup-mount", &e),
        }
        report
    }
}

#[async_trait]
impl Collector for PodNamespaces {
    fn name(&self) -> &'static str {
        "podns"
    }

    /// Pin directories are listed first, the live set read after (a create
    /// records its sandbox before it makes the directory).
    async fn collect(&self, live: &dyn LiveSandboxes) -> GcReport {
        let mut report = GcReport::default();
        match cubelet_engine::blocking(|| self.remove_except(|| live.now())) {
            Ok(n) => report.add("podns", n),
            Err(e) => report.fail("podns", &e),
        }
        report
    }
}
