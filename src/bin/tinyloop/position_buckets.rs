//! `score --buckets`: the mean NLL of the tokens whose position inside their window falls in
//! each range of positions.

use std::str::FromStr;

use serde_json::json;

/// Strictly increasing, positive bucket edges: `128,256` means positions [0, 128), [128, 256)
/// and, when a window is longer than the last edge, [256, window).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketEdges(Vec<usize>);

impl FromStr for BucketEdges {
    type Err = String;

    fn from_str(text: &str) -> Result<BucketEdges, String> {
        if text.trim().is_empty() {
            return Err("the list of bucket edges is empty (example: 128,256,512)".into());
        }
        let mut edges: Vec<usize> = Vec::new();
        for item in text.split(',') {
            let edge: usize = item
                .trim()
                .parse()
                .map_err(|_| format!("bucket edge {item:?} is not a positive integer"))?;
            if edge == 0 {
                return Err("bucket edges must be positive (the first bucket starts at 0)".into());
            }
            if let Some(&last) = edges.last() {
                if edge <= last {
                    return Err(format!(
                        "bucket edges must increase strictly: {edge} follows {last}"
                    ));
                }
            }
            edges.push(edge);
        }
        Ok(BucketEdges(edges))
    }
}

/// Negative log-likelihood summed per bucket of positions.
pub struct PositionBuckets {
    /// The end of each bucket; windows longer than the last edge given add one that ends with
    /// the window.
    ends: Vec<usize>,
    nll: Vec<f64>,
    tokens: Vec<usize>,
}

impl PositionBuckets {
    /// Buckets for windows of `window` tokens.
    pub fn new(edges: &BucketEdges, window: usize) -> PositionBuckets {
        let mut ends = edges.0.clone();
        if ends.last().is_some_and(|&last| window > last) {
            ends.push(window);
        }
        let n = ends.len();
        PositionBuckets {
            ends,
            nll: vec![0.0; n],
            tokens: vec![0; n],
        }
    }

    /// Add one window's log-probabilities; `logprobs[i]` predicts the token at position `i + 1`.
    pub fn add(&mut self, logprobs: &[f32]) {
        for (i, &logprob) in logprobs.iter().enumerate() {
            let bucket = self.ends.partition_point(|&end| end <= i + 1);
            self.nll[bucket] -= f64::from(logprob);
            self.tokens[bucket] += 1;
        }
    }

    /// `(start, end, mean NLL, tokens)` per bucket; the mean is `None` for an empty bucket.
    pub fn rows(&self) -> Vec<(usize, usize, Option<f64>, usize)> {
        let starts = std::iter::once(0).chain(self.ends.iter().copied());
        starts
            .zip(&self.ends)
            .zip(self.nll.iter().zip(&self.tokens))
            .map(|((start, &end), (&nll, &tokens))| {
                let mean = (tokens > 0).then(|| nll / tokens as f64);
                (start, end, mean, tokens)
            })
            .collect()
    }

    pub fn to_json(&self) -> serde_json::Value {
        let rows = self.rows().into_iter().map(|(start, end, nll, tokens)| {
            json!({"start": start, "end": end, "nll": nll, "tokens": tokens})
        });
        serde_json::Value::Array(rows.collect())
    }

    /// One line per bucket, for the text output.
    pub fn lines(&self) -> Vec<String> {
        self.rows()
            .into_iter()
            .map(|(start, end, nll, tokens)| {
                let nll = nll.map_or("-".to_string(), |n| format!("{n:.4}"));
                format!("  positions [{start}, {end}): nll {nll} nats/token  ({tokens} tokens)")
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::{BucketEdges, PositionBuckets};

    #[test]
    fn edges_must_be_a_strictly_increasing_list_of_positive_integers() {
        assert_eq!("128, 256".parse(), Ok(BucketEdges(vec![128, 256])));
        for (bad, says) in [
            ("", "empty"),
            ("0,128", "positive"),
            ("256,128", "128 follows 256"),
            ("128,128", "128 follows 128"),
            ("128,x", "\"x\""),
            ("128,", "\"\""),
        ] {
            let err = bad.parse::<BucketEdges>().unwrap_err();
            assert!(err.contains(says), "{bad:?}: {err}");
        }
    }

    #[test]
    fn tokens_fall_into_the_bucket_of_their_position() {
        let edges: BucketEdges = "2,4".parse().unwrap();
        // A 6-token window predicts positions 1..=5: [0,2) gets 1, [2,4) gets 2 and 3,
        // [4,6), the bucket past the last edge, gets 4 and 5.
        let mut buckets = PositionBuckets::new(&edges, 6);
        buckets.add(&[-1.0, -2.0, -4.0, -8.0, -16.0]);
        // A 3-token window reaches only position 2.
        buckets.add(&[-0.5, -1.5]);
        assert_eq!(
            buckets.rows(),
            vec![
                (0, 2, Some(0.75), 2),
                (2, 4, Some((2.0 + 4.0 + 1.5) / 3.0), 3),
                (4, 6, Some(12.0), 2),
            ]
        );
    }

    #[test]
    fn a_last_bucket_is_added_only_for_windows_past_the_last_edge() {
        let edges: BucketEdges = "2,4".parse().unwrap();
        let mut buckets = PositionBuckets::new(&edges, 4);
        buckets.add(&[-1.0]);
        assert_eq!(buckets.rows(), vec![(0, 2, Some(1.0), 1), (2, 4, None, 0)]);
    }
}
