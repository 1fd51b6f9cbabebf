//! The hybrid topology and the hybrid communicate group (the C API's "Topology and
//! the hybrid communicate group" section).

use std::cell::RefCell;
use std::fmt;
use std::marker::PhantomData;
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::comm::{c_string, Communicator};
use crate::{check, sys, Error, Result, Status};

/// A group kind of the hybrid topology (`hps_group_t`), a newtype over the C value;
/// the first five are its axes. [`Group::from_raw`] builds any value, the library
/// rejects unknown ones with [`Status::InvalidArgument`].
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Group(sys::hps_group_t);

impl Group {
    /// `HPS_GROUP_DP`: data parallel axis.
    pub const DP: Group = Group(sys::hps_group::HPS_GROUP_DP);
    /// `HPS_GROUP_PP`: pipeline axis.
    pub const PP: Group = Group(sys::hps_group::HPS_GROUP_PP);
    /// `HPS_GROUP_SHARDING`: sharding axis.
    pub const SHARDING: Group = Group(sys::hps_group::HPS_GROUP_SHARDING);
    /// `HPS_GROUP_SEP`: sequence parallel axis.
    pub const SEP: Group = Group(sys::hps_group::HPS_GROUP_SEP);
    /// `HPS_GROUP_MP`: model (tensor) parallel axis.
    pub const MP: Group = Group(sys::hps_group::HPS_GROUP_MP);
    /// `HPS_GROUP_CHECK`: the model replica (every rank with this dp coordinate).
    pub const CHECK: Group = Group(sys::hps_group::HPS_GROUP_CHECK);
    /// `HPS_GROUP_SHARDING_CHECK`: every rank with this sharding coordinate.
    pub const SHARDING_CHECK: Group = Group(sys::hps_group::HPS_GROUP_SHARDING_CHECK);

    /// The five axes, slowest first in the default order.
    pub const AXES: [Group; 5] = [Group::DP, Group::PP, Group::SHARDING, Group::SEP, Group::MP];

    /// Every group kind these bindings know.
    pub const ALL: [Group; 7] = [
        Group::DP,
        Group::PP,
        Group::SHARDING,
        Group::SEP,
        Group::MP,
        Group::CHECK,
        Group::SHARDING_CHECK,
    ];

    /// A group kind from its C value, known or not.
    pub const fn from_raw(value: u32) -> Group {
        Group(sys::hps_group(value))
    }

    /// The C value.
    pub const fn raw(self) -> u32 {
        (self.0).0
    }
}

impl fmt::Debug for Group {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match *self {
            Group::DP => "dp",
            Group::PP => "pp",
            Group::SHARDING => "sharding",
            Group::SEP => "sep",
            Group::MP => "mp",
            Group::CHECK => "check",
            Group::SHARDING_CHECK => "sharding_check",
            other => return write!(f, "Group({})", other.raw()),
        };
        write!(f, "Group({})", name)
    }
}

/// Axes dp × pp × sharding × sep × mp and the rank arithmetic (`hps_topology_t`;
/// pure, no communication). Immutable, hence `Send + Sync`. Dropping it calls
/// `hps_topology_destroy`.
pub struct Topology {
    raw: NonNull<sys::hps_topology_t>,
}

// SAFETY: hpshard.h: "a topology is immutable; any thread".
unsafe impl Send for Topology {}
// SAFETY: as above; every method takes &self and only reads.
unsafe impl Sync for Topology {}

impl Topology {
    /// A topology with the given degrees (each >= 1, multiplying to `world_size`)
    /// and axis `order`, slowest first, e.g. `Some("mp,sharding,dp,pp,sep")`; `None`
    /// is the default "dp,pp,sharding,sep,mp" (`hps_topology_create`). Ranks are
    /// row-major, the last axis fastest. Errors: [`Status::InvalidArgument`].
    pub fn new(
        dp: i32,
        pp: i32,
        sharding: i32,
        sep: i32,
        mp: i32,
        world_size: i32,
        order: Option<&str>,
    ) -> Result<Topology> {
        let order = match order {
            Some(order) => Some(c_string("topology order", order)?),
            None => None,
        };
        let order_ptr = order.as_ref().map_or(ptr::null(), |o| o.as_ptr());
        let mut raw: *mut sys::hps_topology_t = ptr::null_mut();
        // SAFETY: order NULL or NUL-terminated and alive; live out-param.
        check(unsafe {
            sys::hps_topology_create(dp, pp, sharding, sep, mp, order_ptr, world_size, &mut raw)
        })?;
        match NonNull::new(raw) {
            Some(raw) => Ok(Topology { raw }),
            None => Err(Error::new(
                Status::Internal,
                "hps_topology_create returned OK and a NULL handle",
            )),
        }
    }

    /// The raw handle, still owned by `self`.
    pub fn as_ptr(&self) -> *const sys::hps_topology_t {
        self.raw.as_ptr()
    }

    /// The degree of `axis` (`Group::DP` .. `Group::MP`) (`hps_topology_degree`).
    /// Errors: [`Status::InvalidArgument`] for a group that is not an axis.
    pub fn degree(&self, axis: Group) -> Result<i32> {
        let mut degree: i32 = 0;
        // SAFETY: live immutable handle; live out-param.
        check(unsafe { sys::hps_topology_degree(self.raw.as_ptr(), axis.0, &mut degree) })?;
        Ok(degree)
    }

    /// `rank`'s coordinate on `axis` (`hps_topology_coordinate`).
    /// Errors: [`Status::OutOfRange`] (rank).
    pub fn coordinate(&self, rank: i32, axis: Group) -> Result<i32> {
        let mut coordinate: i32 = 0;
        // SAFETY: live immutable handle; live out-param.
        check(unsafe {
            sys::hps_topology_coordinate(self.raw.as_ptr(), rank, axis.0, &mut coordinate)
        })?;
        Ok(coordinate)
    }

    /// The rank at the given coordinates (`hps_topology_rank_of`).
    /// Errors: [`Status::OutOfRange`] (a coordinate).
    pub fn rank_of(&self, dp: i32, pp: i32, sharding: i32, sep: i32, mp: i32) -> Result<i32> {
        let mut rank: i32 = 0;
        // SAFETY: live immutable handle; live out-param.
        check(unsafe {
            sys::hps_topology_rank_of(self.raw.as_ptr(), dp, pp, sharding, sep, mp, &mut rank)
        })?;
        Ok(rank)
    }

    /// The ranks of `rank`'s group of kind `group`, ascending (the first is the
    /// group's source rank) (`hps_topology_group_ranks`, resized and retried when the
    /// library reports [`Status::OutOfRange`] with the number needed).
    pub fn group_ranks(&self, group: Group, rank: i32) -> Result<Vec<i32>> {
        let mut ranks: Vec<i32> = vec![0; 16];
        loop {
            let mut count: usize = 0;
            // SAFETY: live immutable handle; ranks valid for ranks.len() entries.
            let raw = unsafe {
                sys::hps_topology_group_ranks(
                    self.raw.as_ptr(),
                    group.0,
                    rank,
                    ranks.as_mut_ptr(),
                    ranks.len(),
                    &mut count,
                )
            };
            if raw == sys::hps_status::HPS_STATUS_OK {
                ranks.truncate(count);
                return Ok(ranks);
            }
            if raw == sys::hps_status::HPS_STATUS_OUT_OF_RANGE && count > ranks.len() {
                ranks.resize(count, 0);
                continue;
            }
            return Err(Error::from_last_call(raw));
        }
    }

    /// The previous and next stage of `rank` in its pipeline, wrapping around
    /// (`hps_topology_pipeline_neighbors`).
    pub fn pipeline_neighbors(&self, rank: i32) -> Result<(i32, i32)> {
        let mut prev: i32 = -1;
        let mut next: i32 = -1;
        // SAFETY: live immutable handle; live out-params.
        check(unsafe {
            sys::hps_topology_pipeline_neighbors(self.raw.as_ptr(), rank, &mut prev, &mut next)
        })?;
        Ok((prev, next))
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        // SAFETY: we own the handle; &mut self, so no reader remains.
        let _ = unsafe { sys::hps_topology_destroy(self.raw.as_ptr()) };
    }
}

impl fmt::Debug for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Topology").field(&self.raw).finish()
    }
}

/// This rank's communicators for every group of a topology (`hps_hybrid_group_t`).
/// Borrows the world communicator, which the C API requires to outlive it.
/// Dropping it calls `hps_hybrid_group_destroy`; communicators taken with
/// [`HybridGroup::comm`] stay valid. Not `Send` (it borrows a communicator that is
/// not `Sync`).
pub struct HybridGroup<'world> {
    raw: NonNull<sys::hps_hybrid_group_t>,
    // Per kind handed out: whether a handle to that communicator is alive.
    taken: RefCell<Vec<(Group, Arc<AtomicBool>)>>,
    _world: PhantomData<&'world Communicator>,
}

impl<'world> HybridGroup<'world> {
    /// Collective over `world` (whose size must equal the topology's): creates every
    /// group's communicator in the same order on every rank
    /// (`hps_hybrid_group_create`). Errors: [`Status::InvalidArgument`], and those
    /// of [`Communicator::create`].
    pub fn create(world: &'world Communicator, topology: &Topology) -> Result<HybridGroup<'world>> {
        let mut raw: *mut sys::hps_hybrid_group_t = ptr::null_mut();
        // SAFETY: live handles; `world` is borrowed for the group's lifetime.
        check(unsafe {
            sys::hps_hybrid_group_create(world.as_ptr(), topology.raw.as_ptr(), &mut raw)
        })?;
        match NonNull::new(raw) {
            Some(raw) => Ok(HybridGroup {
                raw,
                taken: RefCell::new(Vec::new()),
                _world: PhantomData,
            }),
            None => Err(Error::new(
                Status::Internal,
                "hps_hybrid_group_create returned OK and a NULL handle",
            )),
        }
    }

    /// The raw handle, still owned by `self`.
    pub fn as_ptr(&self) -> *mut sys::hps_hybrid_group_t {
        self.raw.as_ptr()
    }

    /// A new handle to this rank's communicator of `kind` (`hps_hybrid_group_comm`);
    /// it shares the communicator with the group and stays valid after the group is
    /// dropped. One handle per kind at a time: a communicator is used by one thread at a
    /// time, and a [`Communicator`] is `Send`, so a second handle to the same one while
    /// the first lives would let two threads use it at once. Errors:
    /// [`Status::InvalidArgument`] (unknown kind), [`Status::FailedPrecondition`] (a
    /// handle of that kind from this group is still alive: drop it first).
    pub fn comm(&self, kind: Group) -> Result<Communicator> {
        let taken = {
            let mut list = self.taken.borrow_mut();
            match list.iter().find(|(k, _)| *k == kind) {
                Some((_, flag)) => Arc::clone(flag),
                None => {
                    let flag = Arc::new(AtomicBool::new(false));
                    list.push((kind, Arc::clone(&flag)));
                    flag
                }
            }
        };
        let mut raw: *mut sys::hps_comm_t = ptr::null_mut();
        // SAFETY: live handle used by this thread; live out-param.
        check(unsafe { sys::hps_hybrid_group_comm(self.raw.as_ptr(), kind.0, &mut raw) })?;
        let mut comm = crate::comm::comm_from_raw(raw, "hps_hybrid_group_comm")?;
        if taken.swap(true, Ordering::AcqRel) {
            return Err(Error::new(
                Status::FailedPrecondition,
                format!(
                    "HybridGroup::comm: a handle to this rank's {kind:?} communicator is still \
                     alive; drop it before taking another (a communicator is used by one \
                     thread at a time)"
                ),
            ));
        }
        comm.hold_group_mark(taken);
        Ok(comm)
    }
}

impl Drop for HybridGroup<'_> {
    fn drop(&mut self) {
        // SAFETY: we own the handle; the world communicator is still alive (borrowed).
        let _ = unsafe { sys::hps_hybrid_group_destroy(self.raw.as_ptr()) };
    }
}

impl fmt::Debug for HybridGroup<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("HybridGroup").field(&self.raw).finish()
    }
}
