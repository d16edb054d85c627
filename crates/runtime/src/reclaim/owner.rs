//! The mark Cubelet puts on every containerd object it creates (containers,
//! snapshots, leases, images): the label [`OWNER_LABEL`]`=`[`OWNER_VALUE`].
//!
//! The garbage collector removes an object it cannot account for only when
//! the object carries the mark, so whatever another client put in the
//! namespace (`ctr`, nerdctl, a second agent configured with the same
//! namespace) is left alone. An unmarked object the store does know (made
//! by a version before the mark) is adopted: the GC labels it.

use std::collections::HashMap;

/// The label key of the owner mark.
pub const OWNER_LABEL: &str = "io.cubelet.runtime/owner";
/// The label value of the owner mark.
pub const OWNER_VALUE: &str = "cubelet";

/// Adds the owner mark to `labels` (over any value a caller put there).
pub fn mark(labels: &mut HashMap<String, String>) {
    labels.insert(OWNER_LABEL.to_owned(), OWNER_VALUE.to_owned());
}

/// Just the owner mark, as a label map.
pub fn owner_labels() -> HashMap<String, String> {
    let mut labels = HashMap::new();
    mark(&mut labels);
    labels
}

/// Whether `labels` carry the owner mark.
pub fn is_marked(labels: &HashMap<String, String>) -> bool {
    labels.get(OWNER_LABEL).is_some_and(|v| v == OWNER_VALUE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mark_overrides_and_is_recognised() {
        let mut labels = HashMap::from([(OWNER_LABEL.to_owned(), "someone-else".to_owned())]);
        assert!(!is_marked(&labels));
        mark(&mut labels);
        assert!(is_marked(&labels));
        assert!(is_marked(&owner_labels()));
        assert!(!is_marked(&HashMap::new()));
    }
}
