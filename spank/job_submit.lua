--[[
torchpass job_submit.lua: make --tp-spares=S really reserve S extra nodes.

SPANK plugins cannot change a job's node count, so the torchpass SPANK
plugin (torchpass.so) only checks the value and records it in the job
control environment (spank_job_control_setenv "TORCHPASS_SPARES"). This
script runs inside slurmctld (JobSubmitPlugins=lua), finds that entry in
job_desc.spank_job_env and adds S to the job's node count:

    sbatch -N 4 --tp-spares=2 job.sh   ->   a 6-node job, TORCHPASS_SPARES=2

`tp run` in the batch script then takes the last 2 of the 6 nodes as hot
spares (TORCHPASS_NODES unset: active = nodes - spares).

Jobs whose script exports TORCHPASS_NODES already counted their spares
(tp-submit renders `export TORCHPASS_NODES=N` and asks sbatch for N+S
nodes itself): they are left alone. Jobs without the entry are untouched.

Install: copy to the directory of slurm.conf as job_submit.lua and set
    JobSubmitPlugins=lua
in slurm.conf (then `scontrol reconfigure`). Keep MAX_SPARES equal to the
plugstack.conf max= of torchpass.so: the SPANK plugin runs on the user's
side and can be bypassed; this check cannot.
]]

local MAX_SPARES = 64

local NO_VAL = slurm.NO_VAL or 4294967294
local NO_VAL16 = slurm.NO_VAL16 or 65534

-- The value torchpass.so recorded, or nil. Slurm stores the entry as
-- "TORCHPASS_SPARES=S" (and shows it to Prolog/Epilog as SPANK_...).
local function recorded_spares(job_desc)
	local env = job_desc.spank_job_env
	local found = nil
	if env ~= nil then
		for _, entry in pairs(env) do
			found = found or string.match(entry, "^TORCHPASS_SPARES=(.*)$")
				or string.match(entry, "^SPANK_TORCHPASS_SPARES=(.*)$")
		end
	end
	return found
end

-- tp-submit (or a script written the same way) asked for N+S nodes itself.
local function counts_its_own_spares(job_desc)
	local script = job_desc.script
	return script ~= nil
		and string.find(script, "\nexport TORCHPASS_NODES=", 1, true) ~= nil
end

local function is_set(value, unset)
	return value ~= nil and value ~= unset and value ~= 0
end

-- Add `spares` nodes to the request (and their tasks, when counted).
local function add_spares(job_desc, spares)
	local min_nodes = is_set(job_desc.min_nodes, NO_VAL) and job_desc.min_nodes or 1
	local total = min_nodes + spares
	job_desc.min_nodes = total
	if is_set(job_desc.max_nodes, NO_VAL) then
		job_desc.max_nodes = job_desc.max_nodes + spares
	end
	if is_set(job_desc.num_tasks, NO_VAL) and is_set(job_desc.ntasks_per_node, NO_VAL16) then
		job_desc.num_tasks = total * job_desc.ntasks_per_node
	end
	return min_nodes, total
end

function slurm_job_submit(job_desc, part_list, submit_uid)
	local raw = recorded_spares(job_desc)
	local rc = slurm.SUCCESS
	if raw == nil or counts_its_own_spares(job_desc) then
		rc = slurm.SUCCESS
	elseif string.match(raw, "^%d+$") == nil or #raw > 4 then
		slurm.log_user("torchpass: TORCHPASS_SPARES=%s is not a number of spare nodes", raw)
		rc = slurm.ERROR
	elseif tonumber(raw) > MAX_SPARES then
		slurm.log_user("torchpass: %s spare nodes asked for, this cluster allows at most %d",
			raw, MAX_SPARES)
		rc = slurm.ERROR
	elseif tonumber(raw) > 0 then
		local active, total = add_spares(job_desc, tonumber(raw))
		slurm.log_info("torchpass: uid %d: %d node(s) + %s spare(s) = %d nodes",
			submit_uid, active, raw, total)
		slurm.log_user("torchpass: %d node(s) + %s hot spare(s) = %d nodes", active, raw, total)
	end
	return rc
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
	return slurm.SUCCESS
end

return slurm.SUCCESS
