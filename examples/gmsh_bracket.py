"""A real geometry with gmsh's Python API: a bracket (a plate with two bolt holes), meshed with
tetrahedra (or, with --dim 2, its 2-D profile with triangles), physical groups on the volume and
on the faces that carry boundary conditions, saved as gmsh .msh v4.1 and converted once to
XDMF + HDF5 for slasolve's parallel reader.

    pip install gmsh                      # the optional extra: pip install 'slasolve[gmsh]'
    python examples/gmsh_bracket.py --size 0.1 --out bracket.msh
    mpirun -n 4 python examples/fem_solve.py --mesh bracket.xdmf --problem elasticity
    python examples/gmsh_bracket.py --recombine       # 3-D: tetrahedra + pyramids, split into tetrahedra
    python examples/gmsh_bracket.py --recombine --collapse    # ... as collapsed hexahedra (Q1; see below)

With ``--collapse`` the tetrahedra and pyramids are written as collapsed hexahedra (exactly P1
on the tetrahedra, the collapsed trilinear element on the pyramids). gmsh's recombination makes
a few pyramids lower than their base is twisted (2 of 334 at --size 0.2, 4 of 777 at 0.1, with
gmsh 4.15), on which the trilinear map folds: assembling on such a file raises ``ValueError``
naming them, hence the split into tetrahedra by default.

Physical groups: volume (3-D) / surface (2-D) 1 = the bracket; facets 1 = the clamped face
(x = 0), 2 = the loaded face (x = length), 3 = the bolt holes.
Only the mesh generation needs gmsh; the conversion to XDMF needs slasolve (h5py, meshio).
"""
import argparse
import os


def build(out: str, size: float = 0.1, dim: int = 3, length: float = 2.0, width: float = 1.0,
          thickness: float = 0.25, hole: float = 0.15, recombine: bool = False) -> str:
    """Mesh the bracket with gmsh and write ``out`` (.msh v4.1, ASCII)."""
    import gmsh

    gmsh.initialize()
    try:
        gmsh.option.setNumber("General.Terminal", 0)
        gmsh.model.add("bracket")
        occ = gmsh.model.occ
        if dim == 3:
            body = occ.addBox(0, 0, 0, length, width, thickness)
            holes = [occ.addCylinder(x, width / 2, -0.1, 0, 0, thickness + 0.2, hole)
                     for x in (0.35 * length, 0.7 * length)]
            occ.cut([(3, body)], [(3, h) for h in holes])
        else:
            body = occ.addRectangle(0, 0, 0, length, width)
            holes = [occ.addDisk(x, width / 2, 0, hole, hole) for x in (0.35 * length, 0.7 * length)]
            occ.cut([(2, body)], [(2, h) for h in holes])
        occ.synchronize()
        tol = 1e-6 * length
        fdim = dim - 1
        clamped, loaded, bolts = [], [], []
        for _, tag in gmsh.model.getEntities(fdim):
            xmin, _, _, xmax, _, _ = gmsh.model.getBoundingBox(fdim, tag)
            if xmax < tol:
                clamped.append(tag)
            elif xmin > length - tol:
                loaded.append(tag)
            elif gmsh.model.getType(fdim, tag) in ("Cylinder", "Circle", "Ellipse"):
                bolts.append(tag)
        gmsh.model.addPhysicalGroup(dim, [t for _, t in gmsh.model.getEntities(dim)], 1)
        for tags, value in ((clamped, 1), (loaded, 2), (bolts, 3)):
            if tags:
                gmsh.model.addPhysicalGroup(fdim, tags, value)
        gmsh.option.setNumber("Mesh.CharacteristicLengthMax", size)
        gmsh.option.setNumber("Mesh.MshFileVersion", 4.1)
        if recombine:    # quads where gmsh can pair triangles: a mixed mesh
            gmsh.option.setNumber("Mesh.RecombineAll", 1)
        gmsh.model.mesh.generate(dim)
        gmsh.write(out)
    finally:
        gmsh.finalize()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bracket.msh")
    p.add_argument("--size", type=float, default=0.1, help="largest element size")
    p.add_argument("--dim", type=int, default=3, choices=(2, 3))
    p.add_argument("--no-convert", action="store_true", help="write the .msh only (needs gmsh only)")
    p.add_argument("--recombine", action="store_true",
                   help="recombine triangles into quads: a mixed mesh (2-D: triangles + quads, as collapsed quads "
                        "(Q1); 3-D: tetrahedra + pyramids under the quads, split into tetrahedra (P1))")
    p.add_argument("--collapse", action="store_true",
                   help="with --recombine in 3-D: tetrahedra and pyramids as collapsed hexahedra (Q1) instead")
    a = p.parse_args()
    build(a.out, a.size, a.dim, recombine=a.recombine)
    print(f"wrote {a.out}")
    if not a.no_convert:
        from slasolve.fem.xdmf import convert_mesh

        xdmf = os.path.splitext(a.out)[0] + ".xdmf"
        # recombination may leave triangles among the quads (2-D: collapsed, Q1 on the quads) and
        # mixes tetrahedra and pyramids (3-D: split into tetrahedra unless --collapse)
        collapse = a.recombine and (a.dim == 2 or a.collapse)
        convert_mesh(a.out, xdmf, simplices=a.recombine and not collapse, collapse=collapse)
        print(f"wrote {xdmf} (+ .h5): read it in parallel with slasolve.fem.read_mesh")


if __name__ == "__main__":
    main()
