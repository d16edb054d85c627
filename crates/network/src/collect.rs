//! The network providers as garbage collectors (namespace pins, veths,
//! leases, host-port rules, CNI attachments).

use async_trait::async_trait;
use cubelet_engine::{Collector, GcReport, LiveSandboxes};

use crate::bridge::GcReport as BridgeGcReport;
use crate::error::NetworkError;
use crate::{BridgeNetwork, CniGcReport, CniNetwork, NoneGcReport, NoneNetwork};

/// A provider's own GC report, counted into the agent's by kind.
trait Tally {
    fn tally(self, report: &mut GcReport);
}

impl Tally for BridgeGcReport {
    fn tally(self, report: &mut GcReport) {
        report.add("netns", self.netns);
        report.add("veth", self.veths);
        report.add("lease", self.leases);
        report.add("port_rule", self.port_rules);
    }
}

impl Tally for CniGcReport {
    fn tally(self, report: &mut GcReport) {
        report.add("cni_attachment", self.attachments);
        report.add("netns", self.netns);
        if self.failed > 0 {
            report.failures.push((
                "network",
                format!(
                    "CNI DEL failed for {} dead sandboxes; retried next pass",
                    self.failed
                ),
            ));
        }
    }
}

impl Tally for NoneGcReport {
    fn tally(self, report: &mut GcReport) {
        report.add("netns", self.netns);
    }
}

/// The agent's report of one provider's pass.
fn report(pass: Result<impl Tally, NetworkError>) -> GcReport {
    let mut report = GcReport::default();
    match pass {
        Ok(r) => r.tally(&mut report),
        Err(e) => report.fail("network", &e),
    }
    report
}

/// Every provider collects under the name "network" (one is configured).
macro_rules! network_collector {
    ($($provider:ty),+) => {$(
        #[async_trait]
        impl Collector for $provider {
            fn name(&self) -> &'static str {
                "network"
            }

            async fn collect(&self, live: &dyn LiveSandboxes) -> GcReport {
                report(self.gc(live).await)
            }
        }
    )+};
}

network_collector!(BridgeNetwork, CniNetwork, NoneNetwork);
