//! The runner's hold on its partitions: the records fetched but not yet handed to a worker, what is
//! in flight, and the offset each partition may commit. Plain data, with no Kafka client in it.
//!
//! The rules, each in one place:
//! - A partition's records go to one unit at a time (the deliveries one worker takes at once), in
//!   offset order, at most `per_unit` of them: records that succeed keep their partition's order,
//!   and a batch takes several records of a partition where it has them. The runner closes a unit
//!   when it hands it to its worker ([`Partitions::close_unit`]); until the unit's records settle,
//!   the next units take other partitions.
//! - A record is handed out only once it is due: a retry waits for its delay on its retry topic,
//!   and a record handed back (its retry or dead letter could not be published) waits for its
//!   back-off, holding back the rest of its partition.
//! - The offset a partition commits is its lowest unfinished record's (in flight, or held here),
//!   or past its highest settled one when none is unfinished: a later record's commit never passes
//!   an earlier unfinished one.
//! - A record parked for an operator (a runner that holds a partition on failure) is never due:
//!   it holds back the rest of its partition until it is retried ([`Partitions::unpark`]) or taken
//!   to be dead-lettered ([`Partitions::take_parked`]).
//! - A revoked partition is forgotten: what was held is dropped (its new owner fetches it from the
//!   committed offset), and what was in flight settles without committing.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;

use rdkafka::message::OwnedMessage;
use tokio::time::Instant;

/// A topic's partition.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) struct TopicPartition {
    pub(super) topic: Arc<str>,
    pub(super) partition: i32,
}

/// A record handed to a worker: where it came from, and which hold on its partition it belongs to.
#[derive(Debug, Clone)]
pub(super) struct Lease {
    pub(super) partition: TopicPartition,
    pub(super) hold: u64,
    pub(super) record: OwnedMessage,
    /// The attempt it is when the runner retries it in place; `None`: as its topic says.
    pub(super) attempt: Option<u32>,
}

/// What the consumer must do after a change: pause or resume fetching a partition.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Fetching {
    Pause(TopicPartition),
    Resume(TopicPartition),
}

#[derive(Debug)]
struct Held {
    offset: i64,
    due: Option<Instant>,
    /// Parked for an operator: never due.
    parked: bool,
    attempt: Option<u32>,
    record: OwnedMessage,
    /// The bytes it holds (key, payload and headers), counted once: what holding it adds to its
    /// partition's bytes is what handing it out takes away.
    size: usize,
}

impl Held {
    fn new(offset: i64, due: Option<Instant>, record: OwnedMessage) -> Self {
        use rdkafka::Message as _;
        use rdkafka::message::Headers as _;
        let headers = record.headers().map_or(0, |headers| {
            headers
                .iter()
                .map(|header| header.key.len() + header.value.map_or(0, <[u8]>::len))
                .sum()
        });
        let size =
            record.key().map_or(0, <[u8]>::len) + record.payload().map_or(0, <[u8]>::len) + headers;
        Self {
            offset,
            due,
            parked: false,
            attempt: None,
            record,
            size,
        }
    }
}

#[derive(Debug)]
struct Partition {
    /// Which hold this is: a partition revoked and assigned again is a new hold, and what was in
    /// flight from the old one settles without effect.
    hold: u64,
    /// Fetched, not handed out: in offset order.
    held: VecDeque<Held>,
    /// Their bytes.
    held_bytes: usize,
    in_flight: BTreeSet<i64>,
    /// The unit that took what is in flight.
    unit: u64,
    /// The highest offset settled.
    settled: Option<i64>,
    /// The offset last given to commit (at first, the one fetching started at).
    committed: Option<i64>,
    paused: bool,
}

impl Partition {
    /// Whether `unit` may take this partition's next record: nothing is in flight, or `unit` took
    /// what is and has room for more.
    fn free_for(&self, unit: u64, per_unit: usize) -> bool {
        self.in_flight.is_empty() || (self.unit == unit && self.in_flight.len() < per_unit)
    }

    /// The offset to commit: the lowest unfinished record's, or past the highest settled one.
    fn commit_offset(&self) -> Option<i64> {
        let lowest_held = self.held.front().map(|held| held.offset);
        let lowest_in_flight = self.in_flight.first().copied();
        match (lowest_held, lowest_in_flight) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (Some(a), None) | (None, Some(a)) => Some(a),
            (None, None) => self.settled.map(|offset| offset + 1),
        }
    }

    fn insert_held(&mut self, held: Held) {
        let at = self
            .held
            .partition_point(|other| other.offset < held.offset);
        if self
            .held
            .get(at)
            .is_some_and(|other| other.offset == held.offset)
        {
            // Fetched again (a seek back): the one here already stands for it.
            return;
        }
        self.held_bytes += held.size;
        self.held.insert(at, held);
    }

    fn take_held(&mut self) -> Held {
        let held = self.held.pop_front().expect("a record is held");
        self.held_bytes -= held.size;
        held
    }

    /// Whether it holds more than `limit` (its fetching pauses).
    fn holds_more_than(&self, limit: HeldLimit) -> bool {
        self.held.len() > limit.records || self.held_bytes > limit.bytes
    }

    /// Whether it holds no more than half of `limit` (its fetching resumes).
    fn holds_at_most_half(&self, limit: HeldLimit) -> bool {
        self.held.len() <= limit.records / 2 && self.held_bytes <= limit.bytes / 2
    }
}

/// How much a partition holds, fetched and not handed out, before its fetching pauses; it resumes
/// at half of it. Pausing a partition drops what the client fetched ahead for it, and resuming
/// fetches again, so a limit hit often costs a fetch's round trip each time.
#[derive(Debug, Clone, Copy)]
pub(super) struct HeldLimit {
    pub(super) records: usize,
    pub(super) bytes: usize,
}

impl Partition {}

/// The runner's partitions; see the [module docs](self).
#[derive(Debug)]
pub(super) struct Partitions {
    partitions: HashMap<TopicPartition, Partition>,
    /// The partitions in the order they are offered to workers, each in turn.
    order: Vec<TopicPartition>,
    next_turn: usize,
    next_hold: u64,
    /// The unit being filled.
    unit: u64,
    per_unit: usize,
    pause_above: HeldLimit,
}

impl Partitions {
    /// Partitions each giving at most `per_unit` records to a unit, whose fetching pauses while
    /// they hold more than `pause_above`.
    pub(super) fn new(per_unit: usize, pause_above: HeldLimit) -> Self {
        Self {
            partitions: HashMap::new(),
            order: Vec::new(),
            next_turn: 0,
            next_hold: 0,
            unit: 0,
            per_unit: per_unit.max(1),
            pause_above: HeldLimit {
                records: pause_above.records.max(1),
                bytes: pause_above.bytes.max(1),
            },
        }
    }

    /// Closes the unit being filled: the records taken from now on belong to the next one.
    pub(super) fn close_unit(&mut self) {
        self.unit += 1;
    }

    /// Holds a fetched `record` of `partition` (due at `due`, when it is a retry's) until a worker
    /// takes it.
    pub(super) fn fetched(
        &mut self,
        partition: TopicPartition,
        record: OwnedMessage,
        due: Option<Instant>,
    ) -> Option<Fetching> {
        use rdkafka::Message as _;
        let offset = record.offset();
        let pause_above = self.pause_above;
        let entry = self.entry(partition.clone());
        if entry.in_flight.contains(&offset) {
            // Fetched again while a worker has it (the consumer seeked back): it stands for itself.
            return None;
        }
        // Where the partition started: nothing before it is this hold's to commit.
        entry.committed.get_or_insert(offset);
        entry.insert_held(Held::new(offset, due, record));
        if !entry.paused && entry.holds_more_than(pause_above) {
            entry.paused = true;
            return Some(Fetching::Pause(partition));
        }
        None
    }

    fn entry(&mut self, partition: TopicPartition) -> &mut Partition {
        if !self.partitions.contains_key(&partition) {
            self.next_hold += 1;
            self.order.push(partition.clone());
        }
        let hold = self.next_hold;
        self.partitions
            .entry(partition)
            .or_insert_with(|| Partition {
                hold,
                held: VecDeque::new(),
                held_bytes: 0,
                in_flight: BTreeSet::new(),
                unit: 0,
                settled: None,
                committed: None,
                paused: false,
            })
    }

    /// The next record a worker may take at `now`, partitions each in turn; with what fetching
    /// must do.
    pub(super) fn next_due(&mut self, now: Instant) -> Option<(Lease, Option<Fetching>)> {
        let count = self.order.len();
        for turn in 0..count {
            let index = (self.next_turn + turn) % count;
            let key = &self.order[index];
            let partition = self
                .partitions
                .get_mut(key)
                .expect("ordered partitions are held");
            let ready = partition.free_for(self.unit, self.per_unit)
                && partition
                    .held
                    .front()
                    .is_some_and(|held| !held.parked && held.due.is_none_or(|due| due <= now));
            if !ready {
                continue;
            }
            let held = partition.take_held();
            partition.in_flight.insert(held.offset);
            partition.unit = self.unit;
            let resume =
                (partition.paused && partition.holds_at_most_half(self.pause_above)).then(|| {
                    partition.paused = false;
                    Fetching::Resume(key.clone())
                });
            self.next_turn = index + 1;
            let lease = Lease {
                partition: key.clone(),
                hold: partition.hold,
                record: held.record,
                attempt: held.attempt,
            };
            return Some((lease, resume));
        }
        None
    }

    /// When the earliest held record that waits for its time is due.
    pub(super) fn next_wake(&self) -> Option<Instant> {
        self.partitions
            .values()
            .filter(|partition| partition.free_for(self.unit, self.per_unit))
            .filter_map(|partition| partition.held.front().and_then(|held| held.due))
            .min()
    }

    /// Notes that the record at `offset` of `partition` (taken under `hold`) is settled; returns
    /// the offset the partition may now commit, when it moved.
    pub(super) fn settled(
        &mut self,
        partition: &TopicPartition,
        hold: u64,
        offset: i64,
    ) -> Option<i64> {
        let partition = self
            .partitions
            .get_mut(partition)
            .filter(|held| held.hold == hold)?;
        if !partition.in_flight.remove(&offset) {
            return None;
        }
        partition.settled = Some(partition.settled.map_or(offset, |s| s.max(offset)));
        let commit = partition.commit_offset()?;
        if partition
            .committed
            .is_some_and(|committed| committed >= commit)
        {
            return None;
        }
        partition.committed = Some(commit);
        Some(commit)
    }

    /// Takes back a record a worker could not settle, to be handed out again at `due`, before the
    /// rest of its partition.
    pub(super) fn handed_back(&mut self, lease: Lease, due: Instant) {
        self.put_back(lease, Some(due), false);
    }

    /// Takes back a record that failed for good, parked before the rest of its partition until an
    /// operator retries or skips it.
    pub(super) fn park(&mut self, lease: Lease) {
        self.put_back(lease, None, true);
    }

    fn put_back(&mut self, lease: Lease, due: Option<Instant>, parked: bool) {
        use rdkafka::Message as _;
        let Some(partition) = self
            .partitions
            .get_mut(&lease.partition)
            .filter(|held| held.hold == lease.hold)
        else {
            return;
        };
        let offset = lease.record.offset();
        if partition.in_flight.remove(&offset) {
            let mut held = Held::new(offset, due, lease.record);
            held.parked = parked;
            held.attempt = lease.attempt;
            partition.insert_held(held);
        }
    }

    /// Whether the record at `offset` of `partition` is parked (first in its partition).
    pub(super) fn is_parked(&self, partition: &TopicPartition, offset: i64) -> bool {
        self.partitions
            .get(partition)
            .and_then(|partition| partition.held.front())
            .is_some_and(|front| front.parked && front.offset == offset)
    }

    /// Makes the record parked at `offset` of `partition` due at once, as attempt `attempt`;
    /// whether one was parked there.
    pub(super) fn unpark(&mut self, partition: &TopicPartition, offset: i64, attempt: u32) -> bool {
        let front = self
            .partitions
            .get_mut(partition)
            .and_then(|partition| partition.held.front_mut())
            .filter(|front| front.parked && front.offset == offset);
        let Some(front) = front else { return false };
        front.parked = false;
        front.due = None;
        front.attempt = Some(attempt);
        true
    }

    /// Takes the record parked at `offset` of `partition` in flight (to be dead-lettered and
    /// settled, or parked again), if one is parked there.
    pub(super) fn take_parked(&mut self, partition: &TopicPartition, offset: i64) -> Option<Lease> {
        let entry = self.partitions.get_mut(partition)?;
        if !entry
            .held
            .front()
            .is_some_and(|front| front.parked && front.offset == offset)
        {
            return None;
        }
        let held = entry.take_held();
        entry.in_flight.insert(held.offset);
        Some(Lease {
            partition: partition.clone(),
            hold: entry.hold,
            record: held.record,
            attempt: held.attempt,
        })
    }

    /// Forgets `revoked` partitions; returns those whose fetching was paused.
    pub(super) fn revoked(&mut self, revoked: &[TopicPartition]) -> Vec<TopicPartition> {
        let mut paused = Vec::new();
        for key in revoked {
            if let Some(partition) = self.partitions.remove(key)
                && partition.paused
            {
                paused.push(key.clone());
            }
        }
        self.order.retain(|key| self.partitions.contains_key(key));
        self.next_turn = 0;
        paused
    }

    /// Forgets every partition (the runner is stopping): what is held is fetched again by whoever
    /// consumes next, from the committed offsets.
    pub(super) fn clear(&mut self) {
        self.partitions.clear();
        self.order.clear();
    }

    /// How many records are held, not yet handed out.
    #[cfg(test)]
    fn held(&self) -> usize {
        self.partitions.values().map(|p| p.held.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::Timestamp;
    use rdkafka::message::OwnedMessage;
    use std::time::Duration;

    fn tp(partition: i32) -> TopicPartition {
        TopicPartition {
            topic: Arc::from("t"),
            partition,
        }
    }

    fn record(partition: i32, offset: i64) -> OwnedMessage {
        OwnedMessage::new(
            None,
            None,
            "t".into(),
            Timestamp::NotAvailable,
            partition,
            offset,
            None,
        )
    }

    fn records(records: usize) -> HeldLimit {
        HeldLimit {
            records,
            bytes: usize::MAX,
        }
    }

    use rdkafka::Message as _;

    fn take(partitions: &mut Partitions, now: Instant) -> Option<(i32, i64, u64)> {
        partitions
            .next_due(now)
            .map(|(lease, _)| (lease.partition.partition, lease.record.offset(), lease.hold))
    }

    #[test]
    fn one_record_of_a_partition_at_a_time_in_offset_order_partitions_in_turn() {
        let now = Instant::now();
        let mut partitions = Partitions::new(1, records(100));
        for offset in 0..3 {
            partitions.fetched(tp(0), record(0, offset), None);
            partitions.fetched(tp(1), record(1, offset), None);
        }
        let (p, o, h0) = take(&mut partitions, now).unwrap();
        assert_eq!((p, o), (0, 0));
        let (p, o, h1) = take(&mut partitions, now).unwrap();
        assert_eq!((p, o), (1, 0));
        assert_eq!(
            take(&mut partitions, now),
            None,
            "each partition has one in flight"
        );
        assert_eq!(partitions.settled(&tp(1), h1, 0), Some(1));
        assert_eq!(take(&mut partitions, now).map(|t| (t.0, t.1)), Some((1, 1)));
        assert_eq!(partitions.settled(&tp(0), h0, 0), Some(1));
    }

    #[test]
    fn a_unit_takes_several_records_of_a_partition_and_the_next_unit_waits_for_them() {
        let now = Instant::now();
        let mut partitions = Partitions::new(3, records(100));
        for offset in 0..4 {
            partitions.fetched(tp(0), record(0, offset), None);
        }
        partitions.fetched(tp(1), record(1, 0), None);
        // The first unit: partitions in turn, each as far as the unit has room.
        let first: Vec<_> = std::iter::from_fn(|| take(&mut partitions, now)).collect();
        let taken: Vec<_> = first.iter().map(|t| (t.0, t.1)).collect();
        assert_eq!(taken, [(0, 0), (1, 0), (0, 1), (0, 2)]);
        partitions.close_unit();
        assert_eq!(
            take(&mut partitions, now),
            None,
            "partition 0's next record waits while the first unit has its earlier ones"
        );
        let hold = first[0].2;
        for offset in 0..2 {
            assert_eq!(partitions.settled(&tp(0), hold, offset), Some(offset + 1));
            assert_eq!(
                take(&mut partitions, now),
                None,
                "offset 2 is still in flight"
            );
        }
        assert_eq!(partitions.settled(&tp(0), hold, 2), Some(3));
        assert_eq!(take(&mut partitions, now).map(|t| (t.0, t.1)), Some((0, 3)));
    }

    #[test]
    fn a_later_commit_never_passes_an_earlier_unfinished_record() {
        let now = Instant::now();
        let mut partitions = Partitions::new(3, records(100));
        for offset in 10..13 {
            partitions.fetched(tp(0), record(0, offset), None);
        }
        let leases: Vec<_> = (0..3)
            .map(|_| take(&mut partitions, now).unwrap())
            .collect();
        let hold = leases[0].2;
        assert_eq!(
            partitions.settled(&tp(0), hold, 12),
            None,
            "10 and 11 are in flight"
        );
        assert_eq!(
            partitions.settled(&tp(0), hold, 11),
            None,
            "10 is in flight"
        );
        assert_eq!(partitions.settled(&tp(0), hold, 10), Some(13));
    }

    #[test]
    fn a_handed_back_record_holds_its_partition_until_it_is_due() {
        let now = Instant::now();
        let mut partitions = Partitions::new(1, records(100));
        partitions.fetched(tp(0), record(0, 0), None);
        partitions.fetched(tp(0), record(0, 1), None);
        let (lease, _) = partitions.next_due(now).unwrap();
        partitions.handed_back(lease, now + Duration::from_secs(1));
        assert_eq!(
            take(&mut partitions, now),
            None,
            "offset 0 is not due; 1 waits behind it"
        );
        assert_eq!(partitions.next_wake(), Some(now + Duration::from_secs(1)));
        let later = now + Duration::from_secs(1);
        assert_eq!(take(&mut partitions, later).map(|t| t.1), Some(0));
    }

    #[test]
    fn a_parked_record_holds_its_partition_until_it_is_unparked_or_taken() {
        let now = Instant::now();
        let mut partitions = Partitions::new(1, records(100));
        for offset in 0..3 {
            partitions.fetched(tp(0), record(0, offset), None);
        }
        partitions.fetched(tp(1), record(1, 0), None);
        let (lease, _) = partitions.next_due(now).unwrap();
        assert_eq!(lease.partition, tp(0));
        partitions.park(lease);
        let later = now + Duration::from_secs(3600);
        assert_eq!(
            take(&mut partitions, later).map(|t| (t.0, t.1)),
            Some((1, 0)),
            "the other partition goes on"
        );
        assert_eq!(
            take(&mut partitions, later),
            None,
            "0:0 is parked, 0:1 waits"
        );
        assert_eq!(partitions.next_wake(), None, "a parked record is never due");
        assert!(!partitions.unpark(&tp(0), 1, 2), "not parked at 1");
        assert!(partitions.unpark(&tp(0), 0, 2));
        let (lease, _) = partitions.next_due(now).unwrap();
        assert_eq!((lease.record.offset(), lease.attempt), (0, Some(2)));
        let hold = lease.hold;
        partitions.park(lease);
        let taken = partitions.take_parked(&tp(0), 0).expect("parked at 0");
        assert!(partitions.take_parked(&tp(0), 0).is_none(), "taken once");
        assert_eq!(take(&mut partitions, now), None, "0:0 is in flight");
        assert_eq!(
            partitions.settled(&tp(0), hold, taken.record.offset()),
            Some(1)
        );
        assert_eq!(take(&mut partitions, now).map(|t| t.1), Some(1));
    }

    #[test]
    fn a_revoked_partition_is_forgotten_and_its_leases_settle_without_committing() {
        let now = Instant::now();
        let mut partitions = Partitions::new(1, records(100));
        partitions.fetched(tp(0), record(0, 0), None);
        partitions.fetched(tp(0), record(0, 1), None);
        let (_, _, old) = take(&mut partitions, now).unwrap();
        partitions.revoked(&[tp(0)]);
        assert_eq!(partitions.held(), 0);
        // Assigned again: a new hold, fetched from the committed offset.
        partitions.fetched(tp(0), record(0, 0), None);
        assert_eq!(partitions.settled(&tp(0), old, 0), None);
        let (_, offset, new) = take(&mut partitions, now).unwrap();
        assert_ne!(old, new);
        assert_eq!(partitions.settled(&tp(0), new, offset), Some(1));
    }

    #[test]
    fn fetching_pauses_above_the_limit_and_resumes_at_half() {
        let now = Instant::now();
        let mut partitions = Partitions::new(1, records(4));
        let mut changes = Vec::new();
        for offset in 0..6 {
            changes.extend(partitions.fetched(tp(0), record(0, offset), None));
        }
        assert_eq!(changes, [Fetching::Pause(tp(0))]);
        let mut resumed = None;
        for offset in 0..4 {
            let (lease, change) = partitions.next_due(now).unwrap();
            partitions.settled(&tp(0), lease.hold, offset);
            resumed = resumed.or(change);
        }
        assert_eq!(resumed, Some(Fetching::Resume(tp(0))));
    }

    #[test]
    fn fetching_pauses_above_the_bytes_limit_and_resumes_at_half() {
        let now = Instant::now();
        let limit = HeldLimit {
            records: 100,
            bytes: 250,
        };
        let mut partitions = Partitions::new(1, limit);
        let sized = |offset| {
            OwnedMessage::new(
                Some(vec![0; 100]),
                None,
                "t".into(),
                Timestamp::NotAvailable,
                0,
                offset,
                None,
            )
        };
        let mut changes = Vec::new();
        for offset in 0..3 {
            changes.extend(partitions.fetched(tp(0), sized(offset), None));
        }
        assert_eq!(
            changes,
            [Fetching::Pause(tp(0))],
            "300 bytes held, over 250"
        );
        let (first, resume) = partitions.next_due(now).unwrap();
        assert_eq!(resume, None, "200 bytes held, over half of 250");
        partitions.settled(&tp(0), first.hold, 0);
        let (_, resume) = partitions.next_due(now).unwrap();
        assert_eq!(resume, Some(Fetching::Resume(tp(0))), "100 bytes held");
    }
}
