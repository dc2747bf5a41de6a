//! Publishing with publisher confirms where a returned message is always the publication's own.
//!
//! A `mandatory` publication that no queue takes comes back as `basic.return`, followed by its
//! `basic.ack`. lapin hands a returned message to the confirmation it resolves next on the
//! channel, and RabbitMQ confirms several publications of a channel with one `basic.ack`
//! (`multiple`): with more than one publication unconfirmed on a channel, the return can reach
//! another publication's confirmation, so that the unroutable message would read as confirmed
//! (and be lost) and a routed one as returned.
//!
//! So a channel is lent to a **group** of publications, and a publication's outcome is decided
//! only once every publication of its group has its confirmation. A return reaches lapin before
//! its publication's confirmation, and lapin hands each to a confirmation it resolves later on the
//! same channel, one each, first come first served; a channel takes a new group only once every
//! confirmation of the last one came. So when a group's confirmations have all come, the returns
//! they carry are exactly the group's (were one left over, the confirmations after it would be
//! fewer than the returns after it, yet each return has its own confirmation after it). The
//! returns are matched to their publications by `message_id`.
//!
//! A group takes publications until the first of its confirmations comes, or until it has
//! [`GROUP`]: publications sent together are confirmed together, as RabbitMQ confirms them. One
//! whose message id is not its own ([`ConfirmChannels::lend`]: a runner's retries and dead
//! letters, which may have none or share one) has a channel to itself. A group whose
//! publication ended without its confirmation (its future dropped, a closed channel) cannot say
//! whose a return was: its other publications end in an error, as if unconfirmed (the relay
//! publishes them again), and its channel is closed, not lent again.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

use lapin::message::BasicReturnMessage;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::ShortString;
use lapin::{BasicProperties, Channel, Confirmation, Connection};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};

/// The most channels publishing at once on one connection; a publication beyond waits for one.
pub(super) const MAX_CHANNELS: usize = 256;

/// The most publications a channel carries at once, as one group.
pub(super) const GROUP: usize = 100;

/// Channels in publisher-confirm mode, each lent to one group of publications at a time.
pub(super) struct ConfirmChannels {
    source: Source,
    state: Mutex<State>,
    permits: Arc<Semaphore>,
}

enum Source {
    /// Opens channels on this connection, as many as are needed.
    Connection(Arc<Connection>),
    /// Has only this channel (already in confirm mode), lent to one publication at a time.
    Channel,
}

struct State {
    idle: Vec<Channel>,
    /// The group that takes more publications, if any.
    open: Option<Arc<Group>>,
}

/// Publications on one channel, each decided once all of them are confirmed.
struct Group {
    channel: Channel,
    /// Its publications' message ids are their own: returns are matched by them.
    shared: bool,
    state: Mutex<GroupState>,
    /// Set when every publication of the group has ended.
    done: watch::Sender<bool>,
}

struct GroupState {
    /// Publications lent the channel.
    members: usize,
    /// Of them, those that ended: with their confirmation, an error, or dropped.
    ended: usize,
    /// Takes no more publications.
    closed: bool,
    /// A publication ended without its confirmation: whose a return was is unknown.
    doubtful: bool,
    /// Its publications' message ids (a shared group's), each at most once.
    ids: HashSet<ShortString>,
    /// The messages returned, by message id.
    returned: HashMap<ShortString, Vec<BasicReturnMessage>>,
    /// The channel's place among [`MAX_CHANNELS`], given back with it.
    permit: Option<OwnedSemaphorePermit>,
}

/// A channel lent to one publication of its group.
pub(super) struct Lent {
    group: Arc<Group>,
    channels: Arc<ConfirmChannels>,
    ended: bool,
}

impl ConfirmChannels {
    /// Returns channels opened on `connection` when they are needed.
    pub(super) fn on(connection: Arc<Connection>) -> Arc<Self> {
        Self::with(Source::Connection(connection), Vec::new(), MAX_CHANNELS)
    }

    /// Returns `channel` (in publisher-confirm mode) lent to one publication at a time.
    pub(super) fn only(channel: Channel) -> Arc<Self> {
        Self::with(Source::Channel, vec![channel], 1)
    }

    fn with(source: Source, idle: Vec<Channel>, channels: usize) -> Arc<Self> {
        Arc::new(Self {
            source,
            state: Mutex::new(State { idle, open: None }),
            permits: Arc::new(Semaphore::new(channels)),
        })
    }

    /// Returns the connection the channels are opened on, if they are.
    pub(super) fn connection(&self) -> Option<&Arc<Connection>> {
        match &self.source {
            Source::Connection(connection) => Some(connection),
            Source::Channel => None,
        }
    }

    /// Returns whether publications can go out: the connection is open (a single channel's
    /// trouble is met by the publication itself).
    pub(super) fn connected(&self) -> bool {
        match &self.source {
            Source::Connection(connection) => connection.status().connected(),
            Source::Channel => true,
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Lends a channel with no other publication awaiting confirmation, for a publication whose
    /// message id may not be its own; waits while [`MAX_CHANNELS`] are lent.
    pub(super) async fn lend(self: &Arc<Self>) -> lapin::Result<Lent> {
        self.lend_to(None).await
    }

    /// Lends a channel for a publication of the message `id`: a place in the open group unless
    /// a publication of the same id is in it, or a new group's channel.
    pub(super) async fn lend_shared(self: &Arc<Self>, id: &str) -> lapin::Result<Lent> {
        let id = ShortString::from(id);
        let shared = matches!(self.source, Source::Connection(_)) && !id.as_str().is_empty();
        if !shared {
            return self.lend_to(None).await;
        }
        if let Some(lent) = self.join(&id) {
            return Ok(lent);
        }
        self.lend_to(Some(id)).await
    }

    /// A place in the open group for a publication of the message `id`, if the group takes one
    /// more and has none of that id.
    fn join(self: &Arc<Self>, id: &ShortString) -> Option<Lent> {
        let mut state = self.state();
        let group = state.open.clone()?;
        let mut of_group = group.state();
        if of_group.closed {
            drop(of_group);
            state.open = None;
            return None;
        }
        if !of_group.ids.insert(id.clone()) {
            return None;
        }
        of_group.members += 1;
        if of_group.members >= GROUP {
            of_group.closed = true;
        }
        drop(of_group);
        Some(Lent {
            group,
            channels: self.clone(),
            ended: false,
        })
    }

    /// A new group's channel: an idle one, or a new one; waits while [`MAX_CHANNELS`] are lent.
    /// The group takes others when its first publication's message `id` is given.
    async fn lend_to(self: &Arc<Self>, id: Option<ShortString>) -> lapin::Result<Lent> {
        let shared = id.is_some();
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        let idle = {
            let mut state = self.state();
            match self.source {
                // The only channel stays, open or not: its trouble is the publication's to meet.
                Source::Channel => state.idle.pop(),
                Source::Connection(_) => {
                    state.idle.retain(|channel| channel.status().connected());
                    state.idle.pop()
                }
            }
        };
        let channel = match (idle, &self.source) {
            (Some(channel), _) => channel,
            (None, Source::Connection(connection)) => {
                let channel = connection.create_channel().await?;
                channel
                    .confirm_select(ConfirmSelectOptions::default())
                    .await?;
                channel
            }
            (None, Source::Channel) => unreachable!("the only channel is lent to one at a time"),
        };
        let group = Arc::new(Group {
            channel,
            shared,
            state: Mutex::new(GroupState {
                members: 1,
                ended: 0,
                closed: !shared,
                doubtful: false,
                ids: id.into_iter().collect(),
                returned: HashMap::new(),
                permit: Some(permit),
            }),
            done: watch::Sender::new(false),
        });
        if shared {
            self.state().open = Some(group.clone());
        }
        Ok(Lent {
            group,
            channels: self.clone(),
            ended: false,
        })
    }

    /// Takes back the channel of a group whose publications have all ended: lent again, or
    /// closed when a return may be left on it.
    fn give_back(&self, channel: Channel, doubtful: bool) {
        match self.source {
            Source::Channel => self.state().idle.push(channel),
            Source::Connection(_) if !doubtful => self.state().idle.push(channel),
            Source::Connection(_) => {
                if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                    runtime.spawn(async move {
                        let _ = channel.close(200, "".into()).await;
                    });
                }
            }
        }
    }
}

impl Group {
    fn state(&self) -> MutexGuard<'_, GroupState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Lent {
    /// Publishes `payload` to `exchange` with `routing_key`, `mandatory` (an unroutable message is
    /// returned), and waits for the broker's confirmation and those of the rest of its group; the
    /// returned message in it, if any, is this publication's.
    pub(super) async fn publish(
        mut self,
        exchange: ShortString,
        routing_key: ShortString,
        payload: &[u8],
        properties: BasicProperties,
    ) -> lapin::Result<Confirmation> {
        let id = properties.message_id().clone();
        let sent = self
            .group
            .channel
            .basic_publish(
                exchange,
                routing_key,
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                payload,
                properties,
            )
            .await;
        let own = match sent {
            Ok(confirming) => confirming.await,
            Err(error) => Err(error),
        };
        let own = self.end(own);
        let mut done = self.group.done.subscribe();
        // Never dropped before it is set: the group holds the sender.
        let _ = done.wait_for(|done| *done).await;
        let mut of_group = self.group.state();
        match own? {
            // Alone on its channel: the return in it, if any, is its own.
            own if !self.group.shared => Ok(own),
            _ if of_group.doubtful => Err(lapin::Error::from(std::io::Error::other(
                "a publication on the same channel ended unconfirmed, so whether this one was \
                 returned is not known",
            ))),
            own => {
                let returned = id.and_then(|id| of_group.returned.get_mut(&id)?.pop());
                Ok(match own {
                    Confirmation::Ack(_) => Confirmation::Ack(returned),
                    Confirmation::Nack(_) => Confirmation::Nack(returned),
                    Confirmation::NotRequested => Confirmation::NotRequested,
                })
            }
        }
    }

    /// Counts this publication's end in its group, with the return its confirmation carried (for
    /// whichever publication of the group it was); the last to end gives the channel back.
    fn end(&mut self, own: lapin::Result<Confirmation>) -> lapin::Result<Confirmation> {
        self.ended = true;
        let mut of_group = self.group.state();
        of_group.ended += 1;
        // The first confirmation closes the group: what is sent from now on goes with another.
        of_group.closed = true;
        let own = match own {
            Ok(Confirmation::Ack(Some(returned))) if self.group.shared => {
                keep(&mut of_group, returned);
                Ok(Confirmation::Ack(None))
            }
            Ok(Confirmation::Nack(Some(returned))) if self.group.shared => {
                keep(&mut of_group, returned);
                Ok(Confirmation::Nack(None))
            }
            Err(error) => {
                of_group.doubtful = true;
                Err(error)
            }
            own => own,
        };
        self.finish_group(of_group);
        own
    }

    /// Gives the channel back and wakes the group once all of its publications ended.
    fn finish_group(&self, mut of_group: MutexGuard<'_, GroupState>) {
        if of_group.ended < of_group.members {
            return;
        }
        let doubtful = of_group.doubtful;
        let permit = of_group.permit.take();
        drop(of_group);
        self.channels
            .give_back(self.group.channel.clone(), doubtful);
        drop(permit);
        self.group.done.send_replace(true);
    }
}

/// Keeps `returned` in its group for the publication of its message id.
fn keep(of_group: &mut GroupState, returned: BasicReturnMessage) {
    let id = returned
        .delivery
        .properties
        .message_id()
        .clone()
        .unwrap_or_default();
    of_group.returned.entry(id).or_default().push(returned);
}

impl Drop for Lent {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        // Dropped before its confirmation: a return may come with it that no one will see.
        let mut of_group = self.group.state();
        of_group.ended += 1;
        of_group.closed = true;
        of_group.doubtful = true;
        self.finish_group(of_group);
    }
}
