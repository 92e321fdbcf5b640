#!/bin/bash
# Builds a small GROMACS system (SPC/E water box, 2 nm, OPLS-AA) into md.tpr in the current directory.
# Usage: gromacs_water.sh NSTEPS
set -euo pipefail
nsteps=${1:-40000}
cat > water.top <<'TOP'
#include "oplsaa.ff/forcefield.itp"
#include "oplsaa.ff/spce.itp"
[ system ]
water
[ molecules ]
TOP
gmx -quiet solvate -cs spc216.gro -box 2 2 2 -o water.gro -p water.top >solvate.log 2>&1
cat > md.mdp <<MDP
integrator = md
dt = 0.002
nsteps = $nsteps
nstxout-compressed = 0
nstenergy = 500
nstlog = 500
cutoff-scheme = Verlet
coulombtype = PME
rcoulomb = 0.9
rvdw = 0.9
tcoupl = V-rescale
tc-grps = System
tau-t = 0.1
ref-t = 300
constraints = h-bonds
gen-vel = yes
gen-seed = 1
MDP
gmx -quiet grompp -f md.mdp -c water.gro -p water.top -o md.tpr -maxwarn 2 >grompp.log 2>&1
