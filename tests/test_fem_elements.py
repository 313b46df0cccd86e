"""Element kernels against independent references (serial, local functions)."""
import itertools

import numpy as np
import pytest
import torch

from slasolve.fem import elements as el
from slasolve.fem import element_volume, elasticity_stiffness, load, mass, stiffness

QUAD_REF = np.array([[0, 0], [1, 0], [1, 1], [0, 1]], dtype=float)
HEX_REF = np.array([[0, 0, 0], [1, 0, 0], [1, 1, 0], [0, 1, 0],
                    [0, 0, 1], [1, 0, 1], [1, 1, 1], [0, 1, 1]], dtype=float)
SIMPLEX_REF = {2: np.array([[0, 0], [1, 0], [0, 1]], float),
               3: np.array([[0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1]], float)}


def random_elements(cell, E=7, seed=0, affine=False):
    """Random positively oriented elements: a random affine map (+ a small
    non-affine perturbation for Q1 unless ``affine``) of the reference cell."""
    rng = np.random.default_rng(seed)
    dim = el.cell_dim(cell)
    ref = {"triangle": SIMPLEX_REF[2], "tetra": SIMPLEX_REF[3], "quad": QUAD_REF, "hexahedron": HEX_REF}[cell]
    out = []
    for _ in range(E):
        while True:
            A = np.eye(dim) + 0.3 * rng.standard_normal((dim, dim))
            if np.linalg.cond(A) < 4:
                break
        if np.linalg.det(A) < 0:
            A[:, 0] *= -1
        x = ref @ A.T + rng.standard_normal(dim)
        if cell in ("quad", "hexahedron") and not affine:
            x = x + 0.05 * rng.standard_normal(x.shape)
        out.append(x)
    return torch.tensor(np.array(out), dtype=torch.float64)


CELLS = ["triangle", "quad", "tetra", "hexahedron"]


# ----------------------------------------------------------------------------- references
def q1_reference_matrices(x, npts):
    """Independent Q1 quadrature on [-1,1]^dim (numpy leggauss), returns (K, M, vol)."""
    dim = x.shape[1]
    ref = QUAD_REF if dim == 2 else HEX_REF
    s = 2 * ref - 1  # vertex signs
    g, w = np.polynomial.legendre.leggauss(npts)
    nv = ref.shape[0]
    K = np.zeros((nv, nv))
    M = np.zeros((nv, nv))
    vol = 0.0
    for idx in itertools.product(range(npts), repeat=dim):
        xi = g[list(idx)]
        wt = np.prod(w[list(idx)])
        fac = 1 + s * xi  # (nv, dim)
        N = fac.prod(1) / 2 ** dim
        dN = np.empty((nv, dim))
        for k in range(dim):
            f = fac.copy()
            f[:, k] = s[:, k]
            dN[:, k] = f.prod(1) / 2 ** dim
        J = x.T @ dN
        det = np.linalg.det(J)
        G = dN @ np.linalg.inv(J)
        K += wt * det * G @ G.T
        M += wt * det * np.outer(N, N)
        vol += wt * det
    return K, M, vol


def p1_gradients(x):
    dim = x.shape[1]
    C = np.linalg.inv(np.hstack([np.ones((dim + 1, 1)), x]))
    vol = abs(np.linalg.det(np.hstack([np.ones((dim + 1, 1)), x]))) / (2 if dim == 2 else 6)
    return C[1:, :].T, vol  # (nv, dim)


# ----------------------------------------------------------------------------- scalar kernels
def test_p1_triangle_stiffness_analytic():
    X = random_elements("triangle", E=9)
    kappa = torch.rand(9, dtype=torch.float64) + 0.5
    K = stiffness(X, kappa, "triangle").numpy()
    for e in range(9):
        x, y = X[e, :, 0].numpy(), X[e, :, 1].numpy()
        b = np.array([y[1] - y[2], y[2] - y[0], y[0] - y[1]])
        c = np.array([x[2] - x[1], x[0] - x[2], x[1] - x[0]])
        area = 0.5 * ((x[1] - x[0]) * (y[2] - y[0]) - (x[2] - x[0]) * (y[1] - y[0]))
        ref = float(kappa[e]) / (4 * area) * (np.outer(b, b) + np.outer(c, c))
        np.testing.assert_allclose(K[e], ref, rtol=1e-12, atol=1e-12)


def test_p1_tetra_stiffness_and_mass_analytic():
    X = random_elements("tetra", E=6, seed=3)
    K = stiffness(X, 2.0, "tetra").numpy()
    M = mass(X, 3.0, "tetra").numpy()
    for e in range(6):
        grad, vol = p1_gradients(X[e].numpy())
        np.testing.assert_allclose(K[e], 2.0 * vol * grad @ grad.T, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(M[e], 3.0 * vol / 20 * (np.ones((4, 4)) + np.eye(4)), rtol=1e-12)


def test_p1_triangle_mass_analytic():
    X = random_elements("triangle", E=5, seed=1)
    M = mass(X, cell="triangle").numpy()
    vol = element_volume(X).numpy()
    for e in range(5):
        np.testing.assert_allclose(M[e], vol[e] / 12 * (np.ones((3, 3)) + np.eye(3)), rtol=1e-12)


@pytest.mark.parametrize("cell", CELLS)
def test_rows_sum_to_zero_and_mass_total_is_volume(cell):
    X = random_elements(cell, seed=4)
    K = stiffness(X, torch.rand(X.shape[0], dtype=torch.float64), cell)
    assert torch.allclose(K.sum(-1), torch.zeros((), dtype=K.dtype), atol=1e-12)
    assert torch.allclose(K, K.transpose(1, 2), atol=1e-13)
    vol = element_volume(X, cell)
    assert (vol > 0).all()
    M = mass(X, 1.0, cell)
    assert torch.allclose(M.sum((1, 2)), vol, rtol=1e-12)
    # constant f: load sums to f * volume; linear f: load integrates exactly
    b = load(X, 2.5, cell)
    assert torch.allclose(b.sum(1), 2.5 * vol, rtol=1e-12)


@pytest.mark.parametrize("cell", CELLS)
def test_volume_known_values(cell):
    dim = el.cell_dim(cell)
    ref = {"triangle": SIMPLEX_REF[2], "tetra": SIMPLEX_REF[3], "quad": QUAD_REF, "hexahedron": HEX_REF}[cell]
    scale = np.arange(2, 2 + dim, dtype=float)
    X = torch.tensor(ref * scale + 1.0)[None]
    expected = np.prod(scale) / {"triangle": 2, "tetra": 6}.get(cell, 1)
    # Jacobian entries are 2^dim-term sums, det J a dim-fold product, the volume a 2^dim-point sum:
    # rounding <= (dim 2^dim + dim + 2^dim) eps ~ 35 eps (hexahedra) whatever the BLAS kernel
    assert float(element_volume(X)) == pytest.approx(expected, rel=1e-13)


def test_quad_shoelace_area():
    X = random_elements("quad", E=8, seed=5)
    x, y = X[..., 0].numpy(), X[..., 1].numpy()
    shoelace = 0.5 * (x * np.roll(y, -1, 1) - np.roll(x, -1, 1) * y).sum(1)
    np.testing.assert_allclose(element_volume(X, "quad").numpy(), shoelace, rtol=1e-12)


@pytest.mark.parametrize("cell", ["quad", "hexahedron"])
def test_q1_against_independent_quadrature(cell):
    # general (non-affine) elements: same 2^dim Gauss rule, independent implementation
    X = random_elements(cell, E=4, seed=6)
    K = stiffness(X, 1.0, cell).numpy()
    M = mass(X, 1.0, cell).numpy()
    for e in range(4):
        Kr, _, vol = q1_reference_matrices(X[e].numpy(), 2)
        _, Mr, _ = q1_reference_matrices(X[e].numpy(), 4)  # mass rules are exact: compare to 4-point
        np.testing.assert_allclose(K[e], Kr, rtol=1e-11, atol=1e-12)
        np.testing.assert_allclose(M[e], Mr, rtol=1e-11, atol=1e-13)
    # affine elements: 2^dim Gauss is exact for the stiffness
    X = random_elements(cell, E=3, seed=7, affine=True)
    K = stiffness(X, 1.0, cell).numpy()
    for e in range(3):
        Kr, _, _ = q1_reference_matrices(X[e].numpy(), 5)
        np.testing.assert_allclose(K[e], Kr, rtol=1e-11, atol=1e-12)


def test_q1_unit_square_known_matrix():
    X = torch.tensor(QUAD_REF)[None]
    ref = np.array([[4, -1, -2, -1], [-1, 4, -1, -2], [-2, -1, 4, -1], [-1, -2, -1, 4]]) / 6
    np.testing.assert_allclose(stiffness(X, 1.0).numpy()[0], ref, atol=1e-14)
    mref = np.array([[4, 2, 1, 2], [2, 4, 2, 1], [1, 2, 4, 2], [2, 1, 2, 4]]) / 36
    np.testing.assert_allclose(mass(X).numpy()[0], mref, atol=1e-15)


def test_load_linear_field_is_consistent():
    X = random_elements("triangle", E=4, seed=8)
    f = torch.rand(4, 3, dtype=torch.float64)
    b = load(X, f, "triangle")
    M = mass(X, 1.0, "triangle")
    assert torch.allclose(b, torch.einsum("eij,ej->ei", M, f))
    # int f = sum of load entries = area * mean of the vertex values (P1)
    assert torch.allclose(b.sum(1), element_volume(X) * f.mean(1), rtol=1e-12)


# ----------------------------------------------------------------------------- elasticity
def d_matrix(E, nu, kind):
    if kind == "plane_stress":
        return E / (1 - nu ** 2) * np.array([[1, nu, 0], [nu, 1, 0], [0, 0, (1 - nu) / 2]])
    if kind == "plane_strain":
        return E / ((1 + nu) * (1 - 2 * nu)) * np.array([[1 - nu, nu, 0], [nu, 1 - nu, 0],
                                                          [0, 0, (1 - 2 * nu) / 2]])
    lam, mu = E * nu / ((1 + nu) * (1 - 2 * nu)), E / (2 * (1 + nu))
    D = np.zeros((6, 6))
    D[:3, :3] = lam
    D[range(3), range(3)] += 2 * mu
    D[range(3, 6), range(3, 6)] = mu
    return D


def b_matrix(grad):
    nv, dim = grad.shape
    if dim == 2:
        B = np.zeros((3, 2 * nv))
        B[0, 0::2] = grad[:, 0]
        B[1, 1::2] = grad[:, 1]
        B[2, 0::2] = grad[:, 1]
        B[2, 1::2] = grad[:, 0]
        return B
    B = np.zeros((6, 3 * nv))
    for d in range(3):
        B[d, d::3] = grad[:, d]
    B[3, 1::3], B[3, 2::3] = grad[:, 2], grad[:, 1]  # yz
    B[4, 0::3], B[4, 2::3] = grad[:, 2], grad[:, 0]  # xz
    B[5, 0::3], B[5, 1::3] = grad[:, 1], grad[:, 0]  # xy
    return B


@pytest.mark.parametrize("cell,kind", [("triangle", "plane_stress"), ("triangle", "plane_strain"),
                                       ("tetra", "3d")])
def test_p1_elasticity_btdb(cell, kind):
    X = random_elements(cell, E=5, seed=9)
    young = torch.rand(5, dtype=torch.float64) + 1
    nu = torch.rand(5, dtype=torch.float64) * 0.4
    K = elasticity_stiffness(X, young, nu, cell, kind).numpy()
    for e in range(5):
        grad, vol = p1_gradients(X[e].numpy())
        B = b_matrix(grad)
        ref = vol * B.T @ d_matrix(float(young[e]), float(nu[e]), kind) @ B
        np.testing.assert_allclose(K[e], ref, rtol=1e-11, atol=1e-11)


def rigid_modes(x):
    nv, dim = x.shape
    modes = []
    for d in range(dim):
        u = np.zeros((nv, dim))
        u[:, d] = 1
        modes.append(u.ravel())
    for a, b in itertools.combinations(range(dim), 2):
        u = np.zeros((nv, dim))
        u[:, a], u[:, b] = -x[:, b], x[:, a]
        modes.append(u.ravel())
    return np.array(modes).T


@pytest.mark.parametrize("cell,kind", [("triangle", "plane_stress"), ("quad", "plane_strain"),
                                       ("tetra", "3d"), ("hexahedron", "3d")])
def test_elasticity_rigid_body_modes(cell, kind):
    X = random_elements(cell, E=4, seed=10)
    K = elasticity_stiffness(X, 2.0, 0.3, cell, kind).numpy()
    dim = X.shape[2]
    nrigid = dim * (dim + 1) // 2
    for e in range(4):
        R = rigid_modes(X[e].numpy())
        assert np.abs(K[e] @ R).max() < 1e-12 * np.abs(K[e]).max()
        np.testing.assert_allclose(K[e], K[e].T, atol=1e-13)
        ev = np.linalg.eigvalsh(K[e])
        assert np.all(ev > -1e-12)
        assert np.sum(ev < 1e-10 * ev.max()) == nrigid  # exactly the rigid modes


def test_top88_KE():
    """Q1 plane stress, unit square, E=1, nu=0.3 reproduces the KE of top88 / top99."""
    nu = 0.3
    X = torch.tensor(QUAD_REF)[None]
    K = elasticity_stiffness(X, 1.0, nu, "quad", "plane_stress")[0].numpy()
    # top99 (Sigmund 2001) form
    k = np.array([1 / 2 - nu / 6, 1 / 8 + nu / 8, -1 / 4 - nu / 12, -1 / 8 + 3 * nu / 8,
                  -1 / 4 + nu / 12, -1 / 8 - nu / 8, nu / 6, 1 / 8 - 3 * nu / 8])
    pat = np.array([[1, 2, 3, 4, 5, 6, 7, 8], [2, 1, 8, 7, 6, 5, 4, 3], [3, 8, 1, 6, 7, 4, 5, 2],
                    [4, 7, 6, 1, 8, 3, 2, 5], [5, 6, 7, 8, 1, 2, 3, 4], [6, 5, 4, 3, 2, 1, 8, 7],
                    [7, 4, 5, 2, 3, 8, 1, 6], [8, 3, 2, 5, 4, 7, 6, 1]]) - 1
    KE99 = 1.0 / (1 - nu ** 2) * k[pat]
    # top88 (Andreassen et al. 2011) form
    A11 = np.array([[12, 3, -6, -3], [3, 12, 3, 0], [-6, 3, 12, -3], [-3, 0, -3, 12]])
    A12 = np.array([[-6, -3, 0, 3], [-3, -6, -3, -6], [0, -3, -6, 3], [3, -6, 3, -6]])
    B11 = np.array([[-4, 3, -2, 9], [3, -4, -9, 4], [-2, -9, -4, -3], [9, 4, -3, -4]])
    B12 = np.array([[2, -3, 4, -9], [-3, 2, 9, -2], [4, 9, 2, 3], [-9, -2, 3, 2]])
    KE88 = 1 / (1 - nu ** 2) / 24 * (np.block([[A11, A12], [A12.T, A11]]) + nu * np.block([[B11, B12], [B12.T, B11]]))
    np.testing.assert_allclose(KE88, KE99, atol=1e-15)
    # our counter-clockwise order (0,0),(1,0),(1,1),(0,1) with x,y dofs: identity
    np.testing.assert_allclose(K, KE88, atol=1e-14)
    # top88's own reading: nodes upper-left, upper-right, lower-right, lower-left
    # (edofMat = [2n1-1 2n1 2n2-1 2n2 2n2+1 2n2+2 2n1+1 2n1+2], column-wise from the
    # top-left) with the y dof pointing down = our vertices [3, 2, 1, 0], y sign flipped
    perm = np.array([[2 * i, 2 * i + 1] for i in (3, 2, 1, 0)]).ravel()
    S = np.diag([1.0, -1.0] * 4)
    np.testing.assert_allclose((S @ K @ S)[np.ix_(perm, perm)], KE88, atol=1e-14)


# ----------------------------------------------------------------------------- autograd
def test_gradcheck_stiffness_kappa():
    X = random_elements("quad", E=3, seed=11)
    kappa = (torch.rand(3, dtype=torch.float64) + 0.5).requires_grad_()
    assert torch.autograd.gradcheck(lambda k: stiffness(X, k, "quad"), (kappa,))
    Xt = random_elements("tetra", E=3, seed=11)
    assert torch.autograd.gradcheck(lambda k: stiffness(Xt, k, "tetra"), (kappa,))


def test_gradcheck_mass_load_elasticity():
    X = random_elements("triangle", E=3, seed=12)
    rho = (torch.rand(3, dtype=torch.float64) + 0.5).requires_grad_()
    f = torch.rand(3, 3, dtype=torch.float64, requires_grad=True)
    young = (torch.rand(3, dtype=torch.float64) + 1).requires_grad_()
    nu = (torch.rand(3, dtype=torch.float64) * 0.3).requires_grad_()
    assert torch.autograd.gradcheck(lambda r: mass(X, r), (rho,))
    assert torch.autograd.gradcheck(lambda g: load(X, g), (f,))
    for kind in ("plane_stress", "plane_strain"):
        assert torch.autograd.gradcheck(lambda y, v: elasticity_stiffness(X, y, v, "triangle", kind), (young, nu),
                                         fast_mode=True)
    Xh = random_elements("hexahedron", E=3, seed=12)
    assert torch.autograd.gradcheck(lambda y, v: elasticity_stiffness(Xh, y, v), (young, nu), fast_mode=True)


def test_gradcheck_coords():
    X = random_elements("quad", E=2, seed=13).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: stiffness(x, 1.0, "quad"), (X,))


def test_float32():
    X = random_elements("hexahedron", E=3, seed=14)
    K64 = stiffness(X, 1.0)
    K32 = stiffness(X.float(), torch.ones(3, dtype=torch.float32))
    assert K32.dtype == torch.float32
    assert torch.allclose(K32.double(), K64, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize("cell", CELLS)
def test_inverted_element_raises(cell):
    X = random_elements(cell, E=6, seed=15)
    flip = {"triangle": [0, 2, 1], "quad": [0, 3, 2, 1], "tetra": [0, 2, 1, 3],
            "hexahedron": [0, 3, 2, 1, 4, 7, 6, 5]}[cell]
    X[2] = X[2, flip]
    X[4] = X[4, flip]
    for fn in (lambda: stiffness(X, 1.0, cell), lambda: mass(X, 1.0, cell), lambda: element_volume(X, cell)):
        with pytest.raises(ValueError, match=r"2 .*non-positive Jacobian.*first is element 2"):
            fn()


def test_degenerate_element_raises():
    X = random_elements("triangle", E=3, seed=16)
    X[1, 2] = 0.5 * (X[1, 0] + X[1, 1])  # collinear
    with pytest.raises(ValueError, match=r"1 triangle.*first is element 1"):
        stiffness(X, 1.0)
    Xq = random_elements("quad", E=3, seed=16)
    Xq[0, 2] = (Xq[0, 0] + Xq[0, 1] + Xq[0, 3]) / 3  # non-convex (reflex angle at vertex 2)
    with pytest.raises(ValueError, match="first is element 0"):
        stiffness(Xq, 1.0)


def test_bad_inputs():
    X = random_elements("triangle", E=3)
    with pytest.raises(TypeError, match="coords"):
        stiffness(X.numpy(), 1.0)
    with pytest.raises(TypeError, match="coords"):
        stiffness(X.long(), 1.0)
    with pytest.raises(ValueError, match="coords"):
        stiffness(X[0], 1.0)
    with pytest.raises(ValueError, match="coords"):
        stiffness(X, 1.0, "quad")
    with pytest.raises(ValueError, match="cell"):
        stiffness(X, 1.0, "pentagon")
    Xn = X.clone()
    Xn[1, 1, 0] = float("nan")
    with pytest.raises(ValueError, match="coords.*NaN"):
        stiffness(Xn, 1.0)
    with pytest.raises(ValueError, match="kappa"):
        stiffness(X, torch.ones(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="kappa.*NaN"):
        stiffness(X, torch.tensor([1.0, float("nan"), 1.0]))
    with pytest.raises(TypeError, match="kappa"):
        stiffness(X, "one")
    with pytest.raises(ValueError, match="rho"):
        mass(X, torch.ones(3, 1))
    with pytest.raises(ValueError, match="f_nodal"):
        load(X, torch.ones(3))
    with pytest.raises(ValueError, match="nu"):
        elasticity_stiffness(X, 1.0, 0.5, "triangle", "plane_strain")
    with pytest.raises(ValueError, match="young"):
        elasticity_stiffness(X, torch.ones(2), 0.3, "triangle", "plane_stress")
    with pytest.raises(ValueError, match="kind"):
        elasticity_stiffness(X, 1.0, 0.3, "triangle")
    with pytest.raises(ValueError, match="kind"):
        elasticity_stiffness(X, 1.0, 0.3, "triangle", "3d")


def test_empty_batch():
    X = torch.zeros(0, 4, 3, dtype=torch.float64)
    assert stiffness(X, 1.0).shape == (0, 4, 4)
    assert elasticity_stiffness(X, 1.0, 0.3).shape == (0, 12, 12)
