//! What the next step of an engine runs: which rows of which sequences, in which order.
//!
//! Every running sequence that has a token to feed gets one decode row; the rows left under the
//! step's budget go to prompts, oldest request first, each taking as many of its remaining
//! prompt tokens as fit (chunked prefill). A step's rows are then ordered by loop count, deepest
//! first, so that loop iteration i runs a prefix of them ([`crate::model::forward::Rows`]).

/// What a running sequence feeds next: more of its prompt, or its last generated token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Demand {
    /// Prompt tokens not yet fed (0: the sequence feeds its last generated token).
    pub prompt_left: usize,
    pub loops: usize,
}

/// Consecutive rows of one sequence in a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Segment {
    /// Index of the sequence in the demands the plan was made from.
    pub sequence: usize,
    /// First row of the segment in the step.
    pub first_row: usize,
    pub rows: usize,
    /// Whether the segment is a decode row (the sequence's last generated token).
    pub decode: bool,
    pub loops: usize,
}

/// The segments of the next step over sequences with `demands`, at most `budget` rows in all,
/// deepest first (ties keep decode rows first, then admission order).
pub(crate) fn plan(demands: &[Demand], budget: usize) -> Vec<Segment> {
    let mut left = budget;
    let mut segments = Vec::new();
    let mut take = |sequence: usize, rows: usize, decode: bool, left: &mut usize| {
        *left -= rows;
        segments.push(Segment {
            sequence,
            first_row: 0,
            rows,
            decode,
            loops: demands[sequence].loops,
        });
    };
    for (i, d) in demands.iter().enumerate() {
        if d.prompt_left == 0 && left > 0 {
            take(i, 1, true, &mut left);
        }
    }
    for (i, d) in demands.iter().enumerate() {
        if d.prompt_left > 0 && left > 0 {
            take(i, d.prompt_left.min(left), false, &mut left);
        }
    }
    segments.sort_by_key(|s| std::cmp::Reverse(s.loops));
    let mut row = 0;
    for s in &mut segments {
        s.first_row = row;
        row += s.rows;
    }
    segments
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(loops: usize) -> Demand {
        Demand {
            prompt_left: 0,
            loops,
        }
    }

    fn prompt(left: usize, loops: usize) -> Demand {
        Demand {
            prompt_left: left,
            loops,
        }
    }

    #[test]
    fn decode_rows_come_before_prompts_under_the_budget() {
        let demands = [prompt(10, 4), decode(4), prompt(10, 4), decode(4)];
        let plan = plan(&demands, 8);
        let picked: Vec<_> = plan
            .iter()
            .map(|s| (s.sequence, s.rows, s.decode))
            .collect();
        assert_eq!(picked, [(1, 1, true), (3, 1, true), (0, 6, false)]);
        let rows: Vec<_> = plan.iter().map(|s| s.first_row).collect();
        assert_eq!(rows, [0, 1, 2]);
    }

    #[test]
    fn rows_come_deepest_first() {
        let demands = [decode(2), decode(16), prompt(3, 8), decode(8)];
        let plan = plan(&demands, 64);
        let order: Vec<_> = plan.iter().map(|s| (s.sequence, s.loops)).collect();
        assert_eq!(order, [(1, 16), (3, 8), (2, 8), (0, 2)]);
        let total: usize = plan.iter().map(|s| s.rows).sum();
        assert_eq!(total, 6);
        assert_eq!(plan.last().unwrap().first_row, 5);
    }

    #[test]
    fn nothing_to_run_plans_nothing() {
        assert!(plan(&[], 8).is_empty());
        assert!(plan(&[decode(4)], 0).is_empty());
    }
}
