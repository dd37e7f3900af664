//! The device mesh: how a generation's world of ranks is arranged into data (`dp`), pipeline (`pp`)
//! and tensor (`tp`) parallel axes, and the sub-communicators each member gets.
//!
//! A [`MeshShape`] `(dp, pp, tp)` with `dp · pp · tp = world` numbers its ranks with `tp` fastest,
//! then `pp`, then `dp` (Megatron's order: the members of a TP group, which talk on every layer,
//! are neighbours, so they share a host first). A member's [`Coord`] names its replica (`dp`), its
//! pipeline stage (`pp`) and its tensor-parallel rank (`tp`). For each axis the ranks that differ only
//! along it form a group: the `tp` group all-reduces activations, the `pp` group carries activations
//! and gradients point to point between neighbouring stages, the `dp` group averages gradients of
//! identical shards. [`MeshGroups::new`] makes those three communicators from the generation's
//! endpoint with no collective call: every member computes the same group ids and member lists from
//! the shape alone. [`check_model`] refuses a shape that does not divide the world, the heads, the
//! vocabulary or the layers, naming the numbers, before any worker starts.

use std::fmt;

use rtx_collectives::{Communicator, Endpoint};

/// One parallel axis of the mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Axis {
    /// Data parallel: replicas of the same shards.
    Dp,
    /// Pipeline parallel: consecutive stages of layers.
    Pp,
    /// Tensor parallel: slices of each layer.
    Tp,
}

impl Axis {
    /// The three axes, in the order their group ids are numbered.
    pub const ALL: [Axis; 3] = [Axis::Dp, Axis::Pp, Axis::Tp];

    fn index(self) -> u64 {
        match self {
            Axis::Dp => 0,
            Axis::Pp => 1,
            Axis::Tp => 2,
        }
    }
}

impl fmt::Display for Axis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Axis::Dp => "dp",
            Axis::Pp => "pp",
            Axis::Tp => "tp",
        })
    }
}

/// The extent of each axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MeshShape {
    /// Replicas.
    pub dp: usize,
    /// Pipeline stages.
    pub pp: usize,
    /// Tensor-parallel ranks per stage.
    pub tp: usize,
}

impl Default for MeshShape {
    /// Plain single-rank training.
    fn default() -> Self {
        MeshShape { dp: 1, pp: 1, tp: 1 }
    }
}

impl fmt::Display for MeshShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "(dp={}, pp={}, tp={})", self.dp, self.pp, self.tp)
    }
}

/// A member's place in the mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Coord {
    /// Replica index.
    pub dp: usize,
    /// Pipeline stage.
    pub pp: usize,
    /// Tensor-parallel rank.
    pub tp: usize,
}

impl Coord {
    /// The coordinate along `axis`.
    pub fn along(&self, axis: Axis) -> usize {
        match axis {
            Axis::Dp => self.dp,
            Axis::Pp => self.pp,
            Axis::Tp => self.tp,
        }
    }

    fn with(mut self, axis: Axis, value: usize) -> Coord {
        match axis {
            Axis::Dp => self.dp = value,
            Axis::Pp => self.pp = value,
            Axis::Tp => self.tp = value,
        }
        self
    }
}

impl fmt::Display for Coord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "(dp={}, pp={}, tp={})", self.dp, self.pp, self.tp)
    }
}

/// Why a mesh or a parallel configuration cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MeshError {
    /// An axis of size zero.
    #[error("[parallel] {axis} = 0: every axis needs at least one rank")]
    ZeroAxis {
        /// The empty axis.
        axis: Axis,
    },
    /// The mesh does not cover the world exactly.
    #[error("[parallel] dp·pp·tp = {dp}·{pp}·{tp} = {product} ranks, but the world has {world}{hint}")]
    WorldMismatch {
        /// Replicas.
        dp: usize,
        /// Stages.
        pp: usize,
        /// Tensor ranks.
        tp: usize,
        /// Their product.
        product: usize,
        /// Members in the generation.
        world: usize,
        /// What to change.
        hint: String,
    },
    /// A model dimension is not divisible by the axis that splits it.
    #[error("[parallel] {axis} = {parts} does not divide the model's {what} ({value})")]
    Indivisible {
        /// The splitting axis.
        axis: Axis,
        /// Its size.
        parts: usize,
        /// Which dimension (`attention heads`, `vocabulary`, `MLP width`).
        what: &'static str,
        /// The dimension.
        value: usize,
    },
    /// More pipeline stages than layers.
    #[error("[parallel] pp = {pp} stages but the model has only {layers} layers: every stage needs one")]
    TooManyStages {
        /// Stages asked for.
        pp: usize,
        /// Layers in the model.
        layers: usize,
    },
    /// A rank or coordinate outside the mesh.
    #[error("{what} is outside the mesh {shape}")]
    OutOfMesh {
        /// The offending rank or coordinate.
        what: String,
        /// The mesh.
        shape: MeshShape,
    },
    /// Making a group's communicator failed.
    #[error("making the {axis} group {members:?}: {source}")]
    Group {
        /// The axis.
        axis: Axis,
        /// Its members (global ranks).
        members: Vec<usize>,
        /// What the endpoint said.
        #[source]
        source: rtx_collectives::Error,
    },
}

/// A [`MeshShape`] checked against a world size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Mesh {
    shape: MeshShape,
}

impl Mesh {
    /// The mesh `shape` over `world` ranks: every axis positive and `dp · pp · tp = world`.
    pub fn new(shape: MeshShape, world: usize) -> Result<Mesh, MeshError> {
        for axis in Axis::ALL {
            if shape.along(axis) == 0 {
                return Err(MeshError::ZeroAxis { axis });
            }
        }
        let product = shape.dp.saturating_mul(shape.pp).saturating_mul(shape.tp);
        if product != world {
            let model = shape.pp.saturating_mul(shape.tp);
            let hint = if product > world {
                format!(": the mesh is larger than the world; launch {product} workers or shrink an axis")
            } else if world.is_multiple_of(model) {
                format!(": with pp·tp = {model}, dp = {} would fill it", world / model)
            } else {
                format!(": pp·tp = {model} does not divide {world}")
            };
            return Err(MeshError::WorldMismatch { dp: shape.dp, pp: shape.pp, tp: shape.tp, product, world, hint });
        }
        Ok(Mesh { shape })
    }

    /// The mesh whose `dp` fills `world` with the given `pp · tp` (the elastic default: the model axes
    /// are fixed, replicas come and go).
    pub fn fill_dp(pp: usize, tp: usize, world: usize) -> Result<Mesh, MeshError> {
        let model = pp.saturating_mul(tp);
        let dp = world.checked_div(model).unwrap_or(0);
        Mesh::new(MeshShape { dp: dp.max(1), pp, tp }, world)
    }

    /// The shape.
    pub fn shape(&self) -> MeshShape {
        self.shape
    }

    /// Ranks in the mesh.
    pub fn world(&self) -> usize {
        self.shape.dp * self.shape.pp * self.shape.tp
    }

    /// The coordinate of `rank`.
    pub fn coord(&self, rank: usize) -> Result<Coord, MeshError> {
        if rank >= self.world() {
            return Err(MeshError::OutOfMesh { what: format!("rank {rank}"), shape: self.shape });
        }
        let MeshShape { pp, tp, .. } = self.shape;
        Ok(Coord { dp: rank / (pp * tp), pp: (rank / tp) % pp, tp: rank % tp })
    }

    /// The rank at `coord`.
    pub fn rank(&self, coord: Coord) -> Result<usize, MeshError> {
        let MeshShape { dp, pp, tp } = self.shape;
        if coord.dp >= dp || coord.pp >= pp || coord.tp >= tp {
            return Err(MeshError::OutOfMesh { what: format!("coordinate {coord}"), shape: self.shape });
        }
        Ok((coord.dp * pp + coord.pp) * tp + coord.tp)
    }

    /// The members of `coord`'s group along `axis` (global ranks, ordered by their coordinate on
    /// the axis, so a member's group rank is its coordinate).
    pub fn group(&self, coord: Coord, axis: Axis) -> Result<Vec<usize>, MeshError> {
        (0..self.shape.along(axis)).map(|i| self.rank(coord.with(axis, i))).collect()
    }

    /// Every coordinate, in rank order.
    pub fn coords(&self) -> impl Iterator<Item = Coord> + '_ {
        (0..self.world()).filter_map(|r| self.coord(r).ok())
    }

    /// A group id for `coord`'s group along `axis`, the same on every member and distinct from the
    /// world group, from every other group of this mesh, and from other meshes' groups.
    pub fn group_id(&self, coord: Coord, axis: Axis) -> u64 {
        // The group's index: the coordinate with the axis itself zeroed, as a rank.
        let leader = (coord.with(axis, 0).dp * self.shape.pp + coord.with(axis, 0).pp) * self.shape.tp + coord.with(axis, 0).tp;
        let shape = ((self.shape.dp as u64) << 40) ^ ((self.shape.pp as u64) << 20) ^ self.shape.tp as u64;
        // High tag bits keep mesh groups apart from the world group (id 0) and `split` children.
        0x4D45_5348_0000_0000 ^ (axis.index() << 56) ^ (shape.wrapping_mul(0x9E37_79B9) << 24) ^ leader as u64
    }
}

impl MeshShape {
    /// The size of `axis`.
    pub fn along(&self, axis: Axis) -> usize {
        match axis {
            Axis::Dp => self.dp,
            Axis::Pp => self.pp,
            Axis::Tp => self.tp,
        }
    }
}

/// The dimensions of a model that the mesh splits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelDims {
    /// Transformer blocks (split over `pp`).
    pub layers: usize,
    /// Attention heads (split over `tp`).
    pub heads: usize,
    /// Vocabulary rows (split over `tp`); 0 when the model has no vocabulary.
    pub vocab: usize,
    /// Feed-forward hidden width (split over `tp`).
    pub mlp_hidden: usize,
}

/// Checks that `shape` fits `world` ranks and splits `model` evenly: the config error a user sees
/// before any worker starts.
pub fn check_model(shape: MeshShape, world: usize, model: ModelDims) -> Result<Mesh, MeshError> {
    let mesh = Mesh::new(shape, world)?;
    let tp = shape.tp;
    for (what, value) in [("attention heads", model.heads), ("vocabulary", model.vocab), ("MLP width", model.mlp_hidden)] {
        if !value.is_multiple_of(tp) {
            return Err(MeshError::Indivisible { axis: Axis::Tp, parts: tp, what, value });
        }
    }
    if shape.pp > model.layers {
        return Err(MeshError::TooManyStages { pp: shape.pp, layers: model.layers });
    }
    Ok(mesh)
}

/// A member's three groups at one generation.
#[derive(Clone)]
pub struct MeshGroups {
    /// The mesh.
    pub mesh: Mesh,
    /// This member's coordinate.
    pub coord: Coord,
    /// Replicas of this member's shard (group rank = `coord.dp`).
    pub dp: Communicator,
    /// This member's pipeline (group rank = `coord.pp`).
    pub pp: Communicator,
    /// This member's tensor-parallel peers (group rank = `coord.tp`).
    pub tp: Communicator,
}

impl fmt::Debug for MeshGroups {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MeshGroups").field("shape", &self.mesh.shape()).field("coord", &self.coord).finish()
    }
}

impl MeshGroups {
    /// The groups of the endpoint's rank at `generation`. No messages are exchanged: every member
    /// derives the same ids and member lists from the mesh.
    pub fn new(endpoint: &Endpoint, mesh: Mesh, generation: u64) -> Result<MeshGroups, MeshError> {
        let coord = mesh.coord(endpoint.rank())?;
        let make = |axis: Axis| -> Result<Communicator, MeshError> {
            let members = mesh.group(coord, axis)?;
            endpoint.group(mesh.group_id(coord, axis), members.clone(), generation).map_err(|source| MeshError::Group { axis, members, source })
        };
        Ok(MeshGroups { mesh, coord, dp: make(Axis::Dp)?, pp: make(Axis::Pp)?, tp: make(Axis::Tp)? })
    }

    /// The group along `axis`.
    pub fn along(&self, axis: Axis) -> &Communicator {
        match axis {
            Axis::Dp => &self.dp,
            Axis::Pp => &self.pp,
            Axis::Tp => &self.tp,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn shape(dp: usize, pp: usize, tp: usize) -> MeshShape {
        MeshShape { dp, pp, tp }
    }

    #[test]
    fn ranks_and_coords_round_trip_with_tp_fastest() {
        let mesh = Mesh::new(shape(2, 2, 2), 8).unwrap();
        assert_eq!(mesh.coord(1).unwrap(), Coord { dp: 0, pp: 0, tp: 1 });
        assert_eq!(mesh.coord(2).unwrap(), Coord { dp: 0, pp: 1, tp: 0 });
        assert_eq!(mesh.coord(4).unwrap(), Coord { dp: 1, pp: 0, tp: 0 });
        for r in 0..8 {
            assert_eq!(mesh.rank(mesh.coord(r).unwrap()).unwrap(), r);
        }
        assert!(matches!(mesh.coord(8), Err(MeshError::OutOfMesh { .. })));
    }

    #[test]
    fn groups_partition_the_world_along_every_axis() {
        for (dp, pp, tp) in [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (1, 2, 2), (2, 2, 2), (3, 2, 1), (2, 3, 4)] {
            let mesh = Mesh::new(shape(dp, pp, tp), dp * pp * tp).unwrap();
            for axis in Axis::ALL {
                let mut seen = BTreeSet::new();
                let mut ids = BTreeSet::new();
                for c in mesh.coords() {
                    let g = mesh.group(c, axis).unwrap();
                    assert_eq!(g[c.along(axis)], mesh.rank(c).unwrap(), "group rank = coordinate");
                    assert_eq!(g.len(), shape(dp, pp, tp).along(axis));
                    if c.along(axis) == 0 {
                        assert!(g.iter().all(|r| seen.insert(*r)), "groups overlap");
                        assert!(ids.insert(mesh.group_id(c, axis)), "group ids collide");
                    }
                    // Every member of a group computes the same id.
                    assert_eq!(mesh.group_id(c, axis), mesh.group_id(mesh.coord(g[0]).unwrap(), axis));
                    assert_ne!(mesh.group_id(c, axis), rtx_collectives::WORLD_GROUP_ID);
                }
                assert_eq!(seen.len(), mesh.world());
            }
        }
    }

    #[test]
    fn bad_shapes_name_their_numbers() {
        let e = Mesh::new(shape(2, 2, 2), 6).unwrap_err();
        assert!(e.to_string().contains("2·2·2 = 8") && e.to_string().contains("world has 6") && e.to_string().contains("larger"), "{e}");
        let e = Mesh::new(shape(1, 3, 1), 4).unwrap_err();
        assert!(e.to_string().contains("does not divide 4"), "{e}");
        assert!(matches!(Mesh::new(shape(1, 0, 1), 0), Err(MeshError::ZeroAxis { axis: Axis::Pp })));
        let dims = ModelDims { layers: 4, heads: 6, vocab: 256, mlp_hidden: 512 };
        let e = check_model(shape(1, 1, 4), 4, dims).unwrap_err();
        assert_eq!(e, MeshError::Indivisible { axis: Axis::Tp, parts: 4, what: "attention heads", value: 6 });
        let e = check_model(shape(1, 8, 1), 8, dims).unwrap_err();
        assert_eq!(e, MeshError::TooManyStages { pp: 8, layers: 4 });
        let e = check_model(shape(1, 1, 3), 3, ModelDims { heads: 3, vocab: 256, ..dims }).unwrap_err();
        assert!(e.to_string().contains("vocabulary (256)"), "{e}");
        assert!(check_model(shape(2, 2, 2), 8, dims).is_ok());
    }

    #[test]
    fn fill_dp_takes_the_replicas_the_world_allows() {
        assert_eq!(Mesh::fill_dp(2, 2, 8).unwrap().shape(), shape(2, 2, 2));
        assert!(Mesh::fill_dp(2, 2, 6).is_err());
    }
}
