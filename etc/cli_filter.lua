-- slurmckpt's site policy at submission (docs/operations.md, "Policy").
--
-- Slurm's cli_filter/lua runs this in sbatch, salloc and srun (CliFilterPlugins=cli_filter/lua in slurm.conf;
-- Slurm reads it as cli_filter.lua next to slurm.conf, and configless Slurm ships it to the clients). When a
-- job asks for --checkpoint-interval, `slurmckpt policy check` says whether slurmckpt.yaml's policy allows
-- that value in the job's partition and QOS; a refusal fails the submission with a message naming the option.
-- Jobs without the option are not looked at (no cost). The root agents apply the same policy to the running
-- job whatever happened here: this check gives the early, clear error, not the enforcement.
--
-- A site with a cli_filter.lua of its own copies slurmckpt_pre_submit() into it and calls it first from its
-- slurm_cli_pre_submit().

-- Where the slurmckpt command may be, first found wins (the Debian package: /usr/bin; make install: the venv
-- and its /usr/local/bin link).
slurmckpt_commands = { "/usr/bin/slurmckpt", "/usr/local/bin/slurmckpt", "/opt/slurmckpt/venv/bin/slurmckpt" }

local function slurmckpt_path()
    for _, path in ipairs(slurmckpt_commands) do
        local f = io.open(path, "r")
        if f then
            f:close()
            return path
        end
    end
    return nil
end

local function quoted(value)
    return "'" .. string.gsub(tostring(value), "'", "'\\''") .. "'"
end

function slurmckpt_pre_submit(options, offset)
    local spank = options["spank"] or {}
    local ours = spank["slurmckpt"] or {}
    local interval = ours["checkpoint-interval"]
    if interval == nil then
        return slurm.SUCCESS
    end
    -- A step inside an allocation runs in the partition that was checked when the job was submitted.
    if options["type"] == "srun" and os.getenv("SLURM_JOB_ID") ~= nil then
        return slurm.SUCCESS
    end
    local binary = slurmckpt_path()
    if binary == nil then
        slurm.log_error("slurmckpt: cannot check --checkpoint-interval against the site policy: no slurmckpt "
                        .. "command found; the job's agents will apply it")
        return slurm.SUCCESS
    end
    local cmd = quoted(binary) .. " policy check --interval " .. quoted(interval)
    if options["partition"] ~= nil then
        cmd = cmd .. " --partition " .. quoted(options["partition"])
    end
    if options["qos"] ~= nil then
        cmd = cmd .. " --qos " .. quoted(options["qos"])
    end
    local pipe = io.popen(cmd .. " 2>&1", "r")
    local answer = pipe and pipe:read("*a") or ""
    if pipe then
        pipe:close()
    end
    answer = string.gsub(answer, "%s+$", "")
    if answer == "ok" then
        return slurm.SUCCESS
    end
    if string.sub(answer, 1, 9) == "refused: " then
        slurm.log_error("%s", string.sub(answer, 10))
        return slurm.ERROR
    end
    slurm.log_error("slurmckpt: the site policy could not be checked (%s); the job's agents will apply it", answer)
    return slurm.SUCCESS
end

function slurm_cli_setup_defaults(options, early_pass)
    return slurm.SUCCESS
end

function slurm_cli_pre_submit(options, offset)
    return slurmckpt_pre_submit(options, offset)
end

function slurm_cli_post_submit(offset, jobid, stepid)
    return slurm.SUCCESS
end
