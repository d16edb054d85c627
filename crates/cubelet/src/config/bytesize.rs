//! Byte sizes as the configuration writes them.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize};

/// A byte size written as `64Mi`, `1Gi`, `512K`, or a plain number of bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// Parses `64Mi`, `1G`, `4096`, ...
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (num, unit) = s.split_at(split);
        let n: u64 = num
            .parse()
            .map_err(|_| format!("{s:?} is not a size (e.g. 64Mi)"))?;
        let mult: u64 = match unit {
            "" => 1,
            "K" | "k" => 1000,
            "M" => 1000_u64.pow(2),
            "G" => 1000_u64.pow(3),
            "Ki" => 1 << 10,
            "Mi" => 1 << 20,
            "Gi" => 1 << 30,
            _ => {
                return Err(format!(
                    "{s:?}: unknown unit {unit:?} (use Ki, Mi, Gi, K, M, G)"
                ))
            }
        };
        n.checked_mul(mult)
            .map(ByteSize)
            .ok_or_else(|| format!("{s:?} is too large"))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.0;
        for (unit, size) in [("Gi", 1u64 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)] {
            if n >= size && n.is_multiple_of(size) {
                return write!(f, "{}{unit}", n / size);
            }
        }
        write!(f, "{n}")
    }
}

impl Serialize for ByteSize {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(u64),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::N(n) => Ok(ByteSize(n)),
            Raw::S(s) => ByteSize::parse(&s).map_err(serde::de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes() {
        assert_eq!(ByteSize::parse("64Mi").unwrap(), ByteSize(64 << 20));
        assert_eq!(ByteSize::parse("1G").unwrap(), ByteSize(1_000_000_000));
        assert_eq!(ByteSize::parse("4096").unwrap(), ByteSize(4096));
        assert!(ByteSize::parse("x").is_err());
        assert_eq!(ByteSize(64 << 20).to_string(), "64Mi");
    }
}
