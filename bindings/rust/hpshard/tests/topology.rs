// Topology arithmetic against the rank formula
// rank = ((((d·P + p)·S + s)·E + e)·M + m) of the default axis order.

use hpshard::{Group, Status, Topology};

const D: i32 = 2;
const P: i32 = 3;
const S: i32 = 2;
const E: i32 = 2;
const M: i32 = 2;
const WORLD: i32 = D * P * S * E * M;

fn formula(c: [i32; 5]) -> i32 {
    (((c[0] * P + c[1]) * S + c[2]) * E + c[3]) * M + c[4]
}

fn coords(rank: i32) -> [i32; 5] {
    let degrees = [D, P, S, E, M];
    let mut c = [0; 5];
    let mut r = rank;
    for axis in (0..5).rev() {
        c[axis] = r % degrees[axis];
        r /= degrees[axis];
    }
    c
}

fn all_ranks_where(pred: impl Fn([i32; 5]) -> bool) -> Vec<i32> {
    (0..WORLD).filter(|&r| pred(coords(r))).collect()
}

#[test]
fn topology_matches_the_rank_formula() {
    let t = Topology::new(D, P, S, E, M, WORLD, None).unwrap();
    let degrees = [D, P, S, E, M];
    for (axis, degree) in Group::AXES.iter().zip(degrees.iter()) {
        assert_eq!(t.degree(*axis).unwrap(), *degree, "{:?}", axis);
    }
    for rank in 0..WORLD {
        let c = coords(rank);
        assert_eq!(formula(c), rank);
        for (i, axis) in Group::AXES.iter().enumerate() {
            assert_eq!(
                t.coordinate(rank, *axis).unwrap(),
                c[i],
                "rank {} {:?}",
                rank,
                axis
            );
        }
        assert_eq!(t.rank_of(c[0], c[1], c[2], c[3], c[4]).unwrap(), rank);
        // Axis groups: the ranks that differ from `rank` only on that axis.
        for (i, axis) in Group::AXES.iter().enumerate() {
            let want = all_ranks_where(|o| (0..5).all(|j| j == i || o[j] == c[j]));
            assert_eq!(
                t.group_ranks(*axis, rank).unwrap(),
                want,
                "rank {} {:?}",
                rank,
                axis
            );
        }
        // CHECK: every rank with this dp coordinate (24 > the first buffer of 16, so
        // the OUT_OF_RANGE sizing protocol is exercised).
        let check = t.group_ranks(Group::CHECK, rank).unwrap();
        assert_eq!(check, all_ranks_where(|o| o[0] == c[0]), "rank {}", rank);
        assert_eq!(check.len(), (WORLD / D) as usize);
        let sharding_check = t.group_ranks(Group::SHARDING_CHECK, rank).unwrap();
        assert_eq!(
            sharding_check,
            all_ranks_where(|o| o[2] == c[2]),
            "rank {}",
            rank
        );
        let (prev, next) = t.pipeline_neighbors(rank).unwrap();
        let mut p = c;
        p[1] = (c[1] + P - 1) % P;
        let mut n = c;
        n[1] = (c[1] + 1) % P;
        assert_eq!((prev, next), (formula(p), formula(n)), "rank {}", rank);
    }
}

#[test]
fn topology_like_the_c_test() {
    let t = Topology::new(2, 2, 2, 1, 1, 8, None).unwrap();
    assert_eq!(t.degree(Group::PP).unwrap(), 2);
    assert_eq!(t.coordinate(5, Group::DP).unwrap(), 1);
    assert_eq!(t.rank_of(1, 0, 1, 0, 0).unwrap(), 5);
    assert_eq!(t.group_ranks(Group::PP, 5).unwrap(), vec![5, 7]);
    assert_eq!(t.group_ranks(Group::CHECK, 5).unwrap(), vec![4, 5, 6, 7]);
    assert_eq!(t.pipeline_neighbors(5).unwrap(), (7, 7));

    let custom = Topology::new(1, 1, 2, 1, 2, 4, Some("mp,sharding,dp,pp,sep")).unwrap();
    assert_eq!(custom.group_ranks(Group::SHARDING, 0).unwrap(), vec![0, 1]);
    assert_eq!(custom.group_ranks(Group::MP, 0).unwrap(), vec![0, 2]);
}

#[test]
fn topology_errors() {
    let t = Topology::new(2, 2, 2, 1, 1, 8, None).unwrap();
    let status = |r: hpshard::Result<i32>| r.unwrap_err().status;
    assert_eq!(status(t.coordinate(8, Group::DP)), Status::OutOfRange);
    assert_eq!(status(t.coordinate(-1, Group::DP)), Status::OutOfRange);
    assert_eq!(status(t.degree(Group::CHECK)), Status::InvalidArgument);
    assert_eq!(
        status(t.degree(Group::from_raw(99))),
        Status::InvalidArgument
    );
    assert_eq!(status(t.rank_of(2, 0, 0, 0, 0)), Status::OutOfRange);
    assert_eq!(
        t.group_ranks(Group::DP, 8).unwrap_err().status,
        Status::OutOfRange
    );
    assert_eq!(
        t.group_ranks(Group::from_raw(99), 0).unwrap_err().status,
        Status::InvalidArgument
    );
    assert_eq!(
        t.pipeline_neighbors(8).unwrap_err().status,
        Status::OutOfRange
    );

    let err = Topology::new(2, 2, 1, 1, 1, 8, None).unwrap_err();
    assert_eq!(err.status, Status::InvalidArgument);
    assert!(!err.message.is_empty());
    for order in [
        "dp,dp,sharding,sep,mp",
        "dp,pp",
        "dp,pp,sharding,sep,tp",
        "a\0b",
    ]
    .iter()
    {
        let err = Topology::new(1, 1, 1, 1, 1, 1, Some(order)).unwrap_err();
        assert_eq!(err.status, Status::InvalidArgument, "{:?}", order);
    }
    assert_eq!(
        Topology::new(0, 1, 1, 1, 1, 0, None).unwrap_err().status,
        Status::InvalidArgument
    );
    assert_eq!(
        format!("{:?}", Group::SHARDING_CHECK),
        "Group(sharding_check)"
    );
    assert_eq!(format!("{:?}", Group::from_raw(42)), "Group(42)");
    assert_eq!(Group::from_raw(Group::MP.raw()), Group::MP);
}

#[test]
fn topology_is_shared_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Topology>();
    let t = Topology::new(D, P, S, E, M, WORLD, None).unwrap();
    std::thread::scope(|s| {
        for part in 0..4 {
            let t = &t;
            s.spawn(move || {
                for rank in (part..WORLD).step_by(4) {
                    let c = coords(rank);
                    assert_eq!(t.rank_of(c[0], c[1], c[2], c[3], c[4]).unwrap(), rank);
                }
            });
        }
    });
}
